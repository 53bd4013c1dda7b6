#!/usr/bin/env bash
# Pitfall mutants: each mutants/NAME.mutant (sNN: the spec's pitfall NN in the
# crate; gNN: the same pitfall in its WGSL kernel) is a set of anchored
# find/replace blocks that mutants/apply.py applies (see its header: blocks
# are found by their text anywhere in src/ and shaders/, so edits and moves do not
# break them). The FIRST line names the test that must catch the mutant:
#
#     # test: <test file stem> <test filter> [more filters]
#     e.g. "# test: precision hand_example_bf16_matmul::cpu"
#
# For each mutant (all mutants/*.mutant, or the names given: `s03 g01` or
# paths) this copies the repository (without target/ and .git) into a scratch
# tree, applies the mutant there, builds, and runs
#     cargo test --release --test <file> -- <filters>
# with TINYLLM_REQUIRE_GPU=1, so a `::gpu` test without an adapter fails the
# baseline instead of passing vacuously. A mutant is "killed" when that run
# fails (or times out), "SURVIVED" when it passes. A mutant that does not
# apply, a tree that does not build, or a filter that selects no test is
# reported as an ERROR, never as killed.
#
# Before the mutants, the unmutated tree runs the same tests once (the
# baseline): a test that already fails cannot kill anything, so the run stops.
# Skip it with NO_BASELINE=1.
#
# Environment:
#   CARGO_TARGET_DIR  shared build dir (default <repo>/target/mutants): the
#                     dependencies are compiled once, the crate incrementally.
#   MUTANT_TIMEOUT    seconds per test run (default 900); a timeout counts as killed.
#   KEEP=1            keep the scratch tree and logs of the last mutant.
#
# Output: one line per mutant ("s01 killed", "s02 SURVIVED", "s03 ERROR (...)"),
# then a total. Exit status 0 only when every mutant was killed.
# Runs are serialised with a lock, so concurrent invocations wait for each other.

set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target/mutants}
export TINYLLM_REQUIRE_GPU=1
timeout_s=${MUTANT_TIMEOUT:-900}
mkdir -p "$CARGO_TARGET_DIR/logs"
work="$CARGO_TARGET_DIR/tree"   # one fixed path: rustc's incremental cache is reused
logs="$CARGO_TARGET_DIR/logs"

# ---- which mutants
patches=()
if [ $# -eq 0 ]; then
    for p in "$here"/*.mutant; do [ -e "$p" ] && patches+=("$p"); done
else
    for a in "$@"; do
        if [ -f "$a" ]; then patches+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")")
        elif [ -f "$here/$a.mutant" ]; then patches+=("$here/$a.mutant")
        elif [ -f "$here/$a" ]; then patches+=("$here/$a")
        else echo "no such mutant: $a" >&2; exit 2
        fi
    done
fi
[ ${#patches[@]} -gt 0 ] || { echo "no mutants/*.mutant found" >&2; exit 2; }

# ---- header: "# test: <file> <filters...>"
header() {
    local line
    line=$(head -n 1 "$1")
    case "$line" in
        "# test: "*) set -- ${line#"# test: "} ;;
        *) return 1 ;;
    esac
    [ $# -ge 2 ] || return 1
    echo "$@"
}

# ---- a fresh copy of the repository at $work (fresh mtimes: cargo rebuilds)
fresh_tree() {
    rm -rf "$work"
    mkdir -p "$work"
    tar -C "$repo" --exclude=./target --exclude=./.git --exclude=./runs -cf - . \
        | tar -C "$work" -xmf -
}

# run_tests <log> <file> <filters...>: 0 passed, 1 failed, 3 build error, 4 no test ran, 124 timeout
run_tests() {
    local log=$1 file=$2
    shift 2
    if ! (cd "$work" && cargo test --release --test "$file" --no-run) >"$log" 2>&1; then
        return 3
    fi
    (cd "$work" && timeout "$timeout_s" cargo test --release --test "$file" -- "$@") >>"$log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && return 124
    if [ $rc -eq 0 ]; then
        # at least one test must have run
        if ! grep -Eq "^test result: ok\. [1-9][0-9]* passed" "$log"; then return 4; fi
        return 0
    fi
    return 1
}

exec 9>"$CARGO_TARGET_DIR/run.lock"
if ! flock -n 9; then
    echo "(another mutants/run.sh holds $CARGO_TARGET_DIR/run.lock: waiting)"
    flock 9
fi

# ---- baseline: every named test passes on the unmutated tree
if [ "${NO_BASELINE:-0}" != 1 ]; then
    declare -A seen=()
    fresh_tree
    for p in "${patches[@]}"; do
        h=$(header "$p") || { echo "$(basename "$p" .mutant) ERROR (first line is not '# test: <file> <filter>')"; exit 2; }
        [ -n "${seen[$h]:-}" ] && continue
        seen[$h]=1
        # shellcheck disable=SC2086
        run_tests "$logs/baseline.log" $h
        rc=$?
        if [ $rc -ne 0 ]; then
            echo "baseline FAILED for '$h' (rc $rc): the unmutated tree must pass; see $logs/baseline.log"
            exit 2
        fi
    done
    echo "baseline: ${#seen[@]} test selection(s) pass unmutated"
fi

# ---- the mutants
killed=0; survived=0; errors=0; names_survived=(); names_error=()
for p in "${patches[@]}"; do
    name=$(basename "$p" .mutant)
    log="$logs/$name.log"
    h=$(header "$p") || { echo "$name ERROR (first line is not '# test: <file> <filter>')"; errors=$((errors+1)); names_error+=("$name"); continue; }
    fresh_tree
    if ! python3 "$here/apply.py" "$p" "$work" >"$log" 2>&1; then
        echo "$name ERROR (does not apply; see $log)"
        errors=$((errors+1)); names_error+=("$name"); continue
    fi
    # shellcheck disable=SC2086
    run_tests "$log.test" $h
    rc=$?
    cat "$log.test" >>"$log"; rm -f "$log.test"
    case $rc in
        0)   echo "$name SURVIVED ($h)"; survived=$((survived+1)); names_survived+=("$name") ;;
        1)   echo "$name killed"; killed=$((killed+1)) ;;
        124) echo "$name killed (timeout after ${timeout_s}s)"; killed=$((killed+1)) ;;
        3)   echo "$name ERROR (does not build; see $log)"; errors=$((errors+1)); names_error+=("$name") ;;
        4)   echo "$name ERROR (the filter '$h' selects no test; see $log)"; errors=$((errors+1)); names_error+=("$name") ;;
    esac
done
[ "${KEEP:-0}" = 1 ] || rm -rf "$work"

total=${#patches[@]}
echo "total: $killed of $total killed, $survived survived, $errors errors"
[ $survived -gt 0 ] && echo "survived: ${names_survived[*]}"
[ $errors -gt 0 ] && echo "errors: ${names_error[*]}"
[ $killed -eq "$total" ]
