//! Flags that are `auto`, `on` or `off` (`--stream-experts`, `--direct-io`).

/// A parsed `auto` / `on` / `off` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    Auto,
    On,
    Off,
}

/// Parses `auto`, `on` (`true`, `yes`) or `off` (`false`, `no`), any case. Errors name `flag`.
pub fn parse_switch(flag: &str, s: &str) -> Result<Switch, String> {
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(Switch::Auto),
        "on" | "true" | "yes" => Ok(Switch::On),
        "off" | "false" | "no" => Ok(Switch::Off),
        _ => Err(format!("{flag} takes auto, on or off, not `{s}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_values_and_names_the_flag() {
        assert_eq!(parse_switch("--x", "AUTO"), Ok(Switch::Auto));
        assert_eq!(parse_switch("--x", "yes"), Ok(Switch::On));
        assert_eq!(parse_switch("--x", "false"), Ok(Switch::Off));
        assert!(parse_switch("--direct-io", "maybe").unwrap_err().contains("--direct-io"));
    }
}
