//! Tokenizer rebuilt from GGUF metadata: round trips and special-token parsing.

mod common;

use strata_formats::ModelFiles;

fn smollm2_tokenizer() -> strata_formats::TextTokenizer {
    ModelFiles::open(common::smollm2_path()).unwrap().tokenizer().unwrap()
}

#[test]
fn unicode_round_trip() {
    let tok = smollm2_tokenizer();
    let texts = [
        "Hello, world! 123 4567",
        "Ünïcödé: naïve café, Straße, ½ × ∞ ≠ ∅",
        "日本語のテキストと中文文本，还有한국어.",
        "emoji 🦀🚀👍🏽 and  double  spaces\tand\ttabs\n\nnew lines",
        "def f(x):\n    return x ** 2  # comment",
        "Ελληνικά, русский, العربية, עברית",
    ];
    for t in texts {
        let ids = tok.encode(t, false).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids, false).unwrap(), t, "ids {ids:?}");
    }
}

#[test]
fn special_tokens_are_parsed_in_prompts() {
    let tok = smollm2_tokenizer();
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&1), "{ids:?}");
    assert_eq!(ids.last(), Some(&2), "{ids:?}");
    // Digits are split one by one (the smollm pre-tokenizer), as llama.cpp does.
    let ids = tok.encode("2024", false).unwrap();
    assert_eq!(ids.len(), 4);
    // Control tokens are skipped when decoding for display.
    assert_eq!(tok.decode(&[1, 30, 2], true).unwrap(), ".");
}

#[test]
fn eos_and_bos_from_metadata() {
    let tok = smollm2_tokenizer();
    assert_eq!(tok.eos_ids, vec![2]);
    assert_eq!(tok.bos_id, Some(1));
    assert!(!tok.add_bos, "add_bos_token is false in this GGUF");
}
