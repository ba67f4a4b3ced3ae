#!/usr/bin/env bash
# Sets up and runs the main job: builds Strata, fetches the default model on first use, and serves
# it over the OpenAI API on http://127.0.0.1:8080. Extra arguments replace the default subcommand,
# e.g. `bash scripts/run.sh generate --prompt Hi`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
if [ $# -eq 0 ]; then
  set -- serve
fi
exec ./target/release/strata "$@"
