#!/usr/bin/env bash
# Fork against cold boot for both shipped templates, one `forkd bench fork` run each.
# Prints the human report; with --json, one JSON report per template on stdout.
#   bench/fork.sh [--json] [extra forkd bench fork flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
forkd=${FORKD_BIN:-target/release/forkd}
[ -x "$forkd" ] || cargo build --release -p forkd
for template in minimal python; do
  "$forkd" bench fork --template "$template" "$@"
done
