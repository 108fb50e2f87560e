#!/usr/bin/env bash
# What an idle child costs the host, for both ways a TCG guest can keep time, measured in
# the same run: for each clock, a daemon of its own builds the python template, forks N
# children, lets them settle for 20 s, then reads each child QEMU's CPU time
# (utime + stime from /proc/PID/stat) over a 10 s window. Prints each child's share of a
# core, the mean per clock, the ratio, and each template build's time.
#   bench/idle.sh [N]     (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-5}
forkd=$(realpath "${FORKD_BIN:-target/release/forkd}")
[ -x "$forkd" ] || cargo build --release -p forkd
assets="${FORKD_HOME:-$HOME/.cache/forkd}"
"$forkd" image build python >/dev/null
hz=$(getconf CLK_TCK)

run() { # CLOCK: prints "mean_percent build_seconds"
  local clock=$1 home daemon
  # Beside the assets (one filesystem: the snapshot hard-links them).
  mkdir -p "$assets/bench"
  home=$(mktemp -d "$assets/bench/idle-XXXXXX")
  ln -s "$assets/images" "$home/images"
  FORKD_HOME=$home FORKD_GUEST_CLOCK=$clock "$forkd" daemon >"$home/daemon.log" 2>&1 &
  daemon=$!
  trap 'kill $daemon 2>/dev/null; rm -rf "$home"' RETURN
  export FORKD_HOME=$home
  until "$forkd" ls >/dev/null 2>&1; do sleep 0.2; done
  local t0 t1
  t0=$(date +%s.%N)
  "$forkd" template build python >/dev/null 2>&1
  t1=$(date +%s.%N)
  "$forkd" fork --tag python -n "$n" >/dev/null
  sleep 20
  local pids
  pids=$("$forkd" ls --json | python3 -c 'import json,sys; print(" ".join(str(s["pid"]) for s in json.load(sys.stdin)))')
  ticks() { for p in $pids; do awk '{print $14 + $15}' "/proc/$p/stat"; done; }
  local a b
  a=($(ticks)); sleep 10; b=($(ticks))
  local sum=0 i pct
  for i in "${!a[@]}"; do
    pct=$(echo "scale=2; 100 * (${b[i]} - ${a[i]}) / $hz / 10" | bc)
    echo "  $clock child $((i + 1)): $pct % of a core" >&2
    sum=$(echo "$sum + $pct" | bc)
  done
  "$forkd" kill --all >/dev/null 2>&1 || true
  echo "$(echo "scale=2; $sum / ${#a[@]}" | bc) $(echo "$t1 - $t0" | bc)"
}

read -r tsc tsc_build < <(run tsc)
read -r icount icount_build < <(run icount)
echo "idle CPU per child: host TSC $tsc %, icount $icount % of a core (ratio $(echo "scale=2; $tsc / $icount" | bc))"
echo "python template build: host TSC $tsc_build s, icount $icount_build s"
