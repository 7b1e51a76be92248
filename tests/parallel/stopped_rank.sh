#!/usr/bin/env bash
# A rank stopped with SIGSTOP in the middle of `mop train` on 3 CPU ranks under mpirun: the
# collective watchdog ends the whole job within its timeout plus a few seconds, and the first error
# line names the stopped rank (its host and pid), not one of the ranks that were waiting for it.
# Exits 77 (skipped, with the reason) where mpirun is not installed.
# Usage: stopped_rank.sh path/to/mop
set -u
mop=$(realpath "$1")
command -v mpirun > /dev/null || { echo "skipped: mpirun is not installed"; exit 77; }
tmp=$(mktemp -d /tmp/mop_stopped_XXXXXX)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# Every mop started here (its working directory is $tmp).
ours() {
  for p in $(pgrep -x mop); do [ "$(readlink "/proc/$p/cwd" 2> /dev/null)" = "$tmp" ] && echo "$p"; done
}
cleanup() {
  for p in $(ours); do kill -CONT "$p"; kill -KILL "$p"; done 2> /dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
cd "$tmp"
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

for i in $(seq 1 300); do echo "line $i: the router sends each token to two experts."; done > corpus.txt
"$mop" prepare-data --input corpus.txt --output data/corpus > /dev/null || { echo "FAIL: prepare-data"; exit 1; }
timeout_s=4
cat > run.yaml <<CONF
model: {vocab_size: 257, hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 6, top_k: 2, expert_ffn: 16}
data: {paths: [data/corpus], seq_len: 32}
train: {steps: 1000000, global_batch_size: 6, micro_batch_size: 2}
parallel: {collective_timeout: $timeout_s, attention: {dp: 3}, moe: {ep: 3}}
checkpoint: {dir: ckpt, interval: 0}
log: {interval: 1}
CONF
mpirun -np 3 --oversubscribe "$mop" train --config run.yaml > out.log 2>&1 &
job=$!
for _ in $(seq 1 240); do
  grep -q "step .*/1000000" out.log && break
  kill -0 "$job" 2> /dev/null || break
  sleep 0.5
done
grep -q "step .*/1000000" out.log || { fail "training did not start:"; tail -n 20 out.log; exit 1; }

victim=""
for p in $(ours); do
  tr '\0' '\n' < "/proc/$p/environ" | grep -qx "OMPI_COMM_WORLD_RANK=1" && victim=$p
done
[ -n "$victim" ] || { fail "no rank 1 among $(ours)"; exit 1; }
start=$(date +%s.%N)
kill -STOP "$victim"
# Wait for mpirun (no longer than a minute); then the time it took.
for _ in $(seq 1 600); do
  kill -0 "$job" 2> /dev/null || break
  sleep 0.1
done
wait "$job" 2> /dev/null
rc=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
echo "job ended (exit $rc) ${elapsed} s after rank 1 (pid $victim) was stopped; watchdog timeout ${timeout_s} s"
[ "$rc" != 0 ] || fail "the job exited 0"
line=$(grep -m 1 "error:" out.log)
echo "first error line: $line"
want="rank 1 (host $(hostname), pid $victim) did not arrive: it does not answer"
[[ "$line" == *"did not finish within ${timeout_s} s; $want"* ]] || fail "the first error line does not name rank 1 ($want)"
[ "$(echo "$elapsed < $timeout_s + 8" | bc)" = 1 ] || fail "the job took ${elapsed} s to end (timeout $timeout_s s)"
sleep 1
[ -z "$(ours)" ] || fail "ranks left running: $(ours)"
[ "$failures" = 0 ] || { tail -n 30 out.log; exit 1; }
echo "stopped rank test passed"
