#!/usr/bin/env bash
# Sets up and runs the main job: builds Strata, fetches the default model on first use, and runs
# it. Extra arguments replace the default subcommand, e.g. `bash scripts/run.sh generate --prompt Hi`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
if [ $# -eq 0 ]; then
  set -- generate --chat "Explain in two sentences why Mixture-of-Experts models can run from an SSD."
fi
exec ./target/release/strata "$@"
