#!/usr/bin/env bash
# Runs every cargo-fuzz target of every crate (crates/*/fuzz) for
# FUZZ_SECONDS each (default 600), FUZZ_JOBS at a time (default 2), at
# `nice -n 19`, then prints a table: target, seconds, executions, crashes.
# A crash is a nonzero exit of the fuzzer or an artifact it wrote
# (crates/<crate>/fuzz/artifacts/<target>/). The table is also saved as
# JSON in $FUZZ_OUT/fuzz.json (default target/fuzz-report, not committed),
# next to each target's libFuzzer log.
#
#   make fuzz                                   # everything, 600 s each
#   FUZZ_SECONDS=60 make fuzz                   # a quick pass
#   FUZZ_TARGETS="spec guest_frames" make fuzz  # only these, in this order
#
# Needs the nightly toolchain (`rustup toolchain install nightly`);
# installs cargo-fuzz if it is missing. Corpora persist in each fuzz
# project's corpus/<target>/ (not committed); a project's seeds/ directory,
# if any, is read too. Exits 1 if any target crashed.
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd)
seconds=${FUZZ_SECONDS:-600}
jobs=${FUZZ_JOBS:-2}
out=${FUZZ_OUT:-$root/target/fuzz-report}
only=${FUZZ_TARGETS:-}

# -max_len per target (the input sizes each target needs); default 4096.
declare -A max_len=(
    [image_files]=131072 [channel_log]=65536 [cluster_manifest]=16384
    [read_stream]=9000 [parse_return_path]=600
    [dhcp_frame]=2048 [guest_frames]=8192
    [coord_messages]=4096 [control_request]=4096 [spec]=4096
    [qcow2_file]=262144
)

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: the nightly toolchain is missing: rustup toolchain install nightly" >&2
    exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz" >&2
    cargo install --locked cargo-fuzz
fi

mkdir -p "$out"
# Build every project first, so that the fuzzing time is not build time.
declare -a queue=()
for dir in crates/*/fuzz; do
    [ -f "$dir/Cargo.toml" ] || continue
    targets=$(cd "$dir" && cargo +nightly fuzz list)
    selected=()
    for t in $targets; do
        if [ -z "$only" ] || [[ " $only " == *" $t "* ]]; then
            selected+=("$t")
            queue+=("$dir:$t")
        fi
    done
    ((${#selected[@]})) || continue
    echo "fuzz: building $dir (${selected[*]})" >&2
    for t in "${selected[@]}"; do
        (cd "$dir" && nice -n 19 cargo +nightly fuzz build "$t") >"$out/build.log" 2>&1 || {
            cat "$out/build.log" >&2
            exit 2
        }
    done
done
# With FUZZ_TARGETS, run in its order (e.g. the newest targets first).
if [ -n "$only" ]; then
    ordered=()
    for want in $only; do
        for item in "${queue[@]}"; do
            [ "${item#*:}" = "$want" ] && ordered+=("$item")
        done
    done
    queue=("${ordered[@]}")
fi
if ((${#queue[@]} == 0)); then
    echo "fuzz: no target matches FUZZ_TARGETS=\"$only\"" >&2
    exit 2
fi

# One target: run it, then write its result line to $out/<target>.result.
run_one() {
    local dir=$1 t=$2
    local log="$out/$t.log" art="$dir/artifacts/$t"
    mkdir -p "$dir/corpus/$t" "$art"
    local before
    before=$(find "$art" -type f | wc -l)
    local corpora=("corpus/$t")
    [ -d "$dir/seeds" ] && corpora+=(seeds)
    local start rc=0
    start=$(date +%s)
    (cd "$dir" && nice -n 19 cargo +nightly fuzz run "$t" "${corpora[@]}" -- \
        -max_total_time="$seconds" -max_len="${max_len[$t]:-4096}" -timeout=10 \
        -rss_limit_mb=2048 -malloc_limit_mb=512 -print_final_stats=1) >"$log" 2>&1 || rc=$?
    local took=$(($(date +%s) - start))
    local after
    after=$(find "$art" -type f | wc -l)
    # Executions: libFuzzer's "Done N runs in S second(s)", else its final
    # stats, else the last "#N ..." status line (a crash ends without Done).
    local execs
    execs=$(sed -n 's/^Done \([0-9]*\) runs in .*/\1/p' "$log" | tail -1)
    [ -n "$execs" ] || execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
    [ -n "$execs" ] || execs=$(sed -n 's/^#\([0-9]*\)[[:space:]].*/\1/p' "$log" | tail -1)
    [ -n "$execs" ] || execs=0
    local crashes=$((after - before))
    if ((rc != 0 && crashes == 0)); then crashes=1; fi
    echo "$t $took $execs $crashes $rc $dir" >"$out/$t.result"
    echo "fuzz: $t done: ${took}s, $execs runs, $crashes crashes (exit $rc)" >&2
}

rm -f "$out"/*.result
echo "fuzz: ${#queue[@]} targets, ${seconds}s each, $jobs at a time, logs in $out" >&2
running=0
for item in "${queue[@]}"; do
    if ((running >= jobs)); then
        wait -n || true
        running=$((running - 1))
    fi
    run_one "${item%%:*}" "${item#*:}" &
    running=$((running + 1))
done
wait || true

failed=0
printf '%-20s %8s %14s %8s\n' target seconds executions crashes
json="["
sep=""
for item in "${queue[@]}"; do
    t=${item#*:}
    read -r name took execs crashes rc dir <"$out/$t.result"
    printf '%-20s %8s %14s %8s\n' "$name" "$took" "$execs" "$crashes"
    ((crashes == 0)) || failed=1
    json+=$(printf '%s\n  {"target": "%s", "project": "%s", "seconds": %s, "executions": %s, "crashes": %s, "exit": %s}' \
        "$sep" "$name" "$dir" "$took" "$execs" "$crashes" "$rc")
    sep=","
done
printf '%s\n]\n' "$json" >"$out/fuzz.json"
echo "fuzz: table saved as $out/fuzz.json" >&2
exit $failed
