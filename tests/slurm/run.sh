#!/usr/bin/env bash
# scripts/slurm/train.sbatch under a real Slurm: a one-node cluster on this machine (its own munge
# and slurm.conf, CPU ranks), and configs/tiny.yaml-sized runs on 2 tasks:
#   1. sbatch of the template trains to the end;
#   2. a real time limit (--time=3 --signal=B:USR1@100): the notice makes the ranks checkpoint,
#      the job requeues itself and resumes (again at each limit, until the test cancels it); once
#      more with --time=4 --signal=B:USR1@150 where Slurm's check came too late to requeue at all;
#   3. scancel --signal=USR1 (the notice by hand, to the ranks): they checkpoint, rank 0 requeues
#      the job, it resumes and completes;
#   4. kill -9 of one task: the job fails; `scontrol requeue` resumes it from the last checkpoint
#      and it completes.
#   Every step's losses equal an uninterrupted run's, bit for bit (a constant learning rate, so
#   that runs of different lengths share their first steps).
# Exits 77 (skipped, with the reason) where Slurm or munge is not installed.
# Usage: run.sh path/to/mop path/to/source
set -u
mop=$(realpath "$1")
src=$(realpath "$2")
for tool in slurmctld slurmd munged sbatch scontrol scancel squeue; do
  if ! command -v "$tool" > /dev/null && [ ! -x "/usr/sbin/$tool" ]; then
    echo "skipped: $tool is not installed (Debian: apt-get install slurmctld slurmd slurm-client munge)"
    exit 77
  fi
done
export PATH=$PATH:/usr/sbin
tmp=$(mktemp -d /tmp/mop_slurm_XXXXXX)
failures=0
cleanup() {
  [ -f "$tmp/slurmd.pid" ] && kill "$(cat "$tmp/slurmd.pid")" 2> /dev/null
  [ -f "$tmp/slurmctld.pid" ] && kill "$(cat "$tmp/slurmctld.pid")" 2> /dev/null
  [ -f "$tmp/munged.pid" ] && kill "$(cat "$tmp/munged.pid")" 2> /dev/null
  pkill -f "mop train --config $tmp" 2> /dev/null
  sleep 1
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# munge: a key and a daemon of our own on our own socket.
dd if=/dev/urandom of="$tmp/munge.key" bs=1024 count=1 status=none
chmod 0400 "$tmp/munge.key"
mkdir -p "$tmp/munge" && chmod 0700 "$tmp/munge"
munged --force --socket="$tmp/munge/munge.socket" --key-file="$tmp/munge.key" \
  --pid-file="$tmp/munged.pid" --log-file="$tmp/munged.log" --seed-file="$tmp/munged.seed" \
  || { echo "skipped: munged does not start here ($(tail -n 1 "$tmp/munged.log" 2> /dev/null))"; exit 77; }

# slurm.conf: this host, its cores, ports of our own; no cgroups, accounting or GPUs.
# start_cluster: a controller and a node on a random port pair; 0 once the node is idle.
host=$(hostname -s)
start_cluster() {
  port=$((20000 + RANDOM % 20000))
  cat > "$tmp/slurm.conf" <<CONF
ClusterName=moptest
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$tmp/munge/munge.socket,cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ReturnToService=2
MpiDefault=pmix
KillWait=5
MinJobAge=600
JobRequeue=1
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
  rm -rf "$tmp/state" "$tmp/spool"
  mkdir -p "$tmp/state" "$tmp/spool"
  export SLURM_CONF=$tmp/slurm.conf
  slurmctld -f "$SLURM_CONF" || { echo "skipped: slurmctld does not start here"; tail -n 5 "$tmp/slurmctld.log"; exit 77; }
  slurmd -f "$SLURM_CONF" || { echo "skipped: slurmd does not start here"; tail -n 5 "$tmp/slurmd.log"; exit 77; }
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt 40 ]; do
    timeout 5 sinfo -h -o %t 2> /dev/null | grep -q idle && return 0
    sleep 0.5
  done
  return 1
}
stop_cluster() {
  [ -f "$tmp/slurmd.pid" ] && kill "$(cat "$tmp/slurmd.pid")" 2> /dev/null
  [ -f "$tmp/slurmctld.pid" ] && kill "$(cat "$tmp/slurmctld.pid")" 2> /dev/null
  sleep 2
  rm -f "$tmp/slurmd.pid" "$tmp/slurmctld.pid"
}
# Once in CI the node never reached the controller (connect failure on every try): up to three
# port pairs, each given 40 s (each failed try shows both daemons' last log lines), then skip.
up=0
for attempt in 1 2 3; do
  start_cluster && { up=1; break; }
  echo "note: the node did not come up on ports $port-$((port + 1)) (attempt $attempt)"
  tail -n 3 "$tmp/slurmctld.log" "$tmp/slurmd.log" 2> /dev/null
  stop_cluster
  mv "$tmp/slurmctld.log" "$tmp/slurmctld.$attempt.log" 2> /dev/null
  mv "$tmp/slurmd.log" "$tmp/slurmd.$attempt.log" 2> /dev/null
done
[ "$up" = 1 ] || { echo "skipped: the node does not come up"; exit 77; }
echo "ok: one-node Slurm on $host (port $port)"

# A corpus and a tiny model on 2 CPU ranks (dp 2), a checkpoint every 5 steps.
cd "$tmp"
for i in $(seq 1 400); do echo "line $i of the corpus: the router sends each token to two experts."; done > corpus.txt
"$mop" prepare-data --input corpus.txt --output data/corpus > /dev/null 2>&1 || fail "prepare-data"
config() {  # config NAME STEPS [CHECKPOINT_INTERVAL]: checkpoints in NAME/
  cat > "$tmp/$1.yaml" <<YAML
model: {vocab_size: 257, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2}
moe: {num_experts: 4, top_k: 2, expert_ffn: 32}
optim: {schedule: constant, warmup_steps: 20}
data: {paths: [$tmp/data/corpus], seq_len: 64}
train: {steps: $2, global_batch_size: 4, micro_batch_size: 1, device: cpu}
parallel: {attention: {dp: 2}, moe: {dp: 2}}
checkpoint: {dir: $tmp/$1, interval: ${3:-50}, save_final: true}
log: {interval: 1000}
YAML
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MOP=$mop
# sbatch overrides the template's GPU node shape: 2 CPU tasks, no GPUs, sharing the node.
submit() {  # submit NAME [sbatch options]: prints the job id
  local name=$1
  shift
  sbatch --parsable --chdir="$tmp" --output="$tmp/$name.out" --ntasks-per-node=2 --cpus-per-task=1 \
    --gpus-per-node=0 --oversubscribe "$@" "$src/scripts/slurm/train.sbatch" "$tmp/$name.yaml"
}
state() { scontrol show job "$1" 2> /dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
restarts() { scontrol show job "$1" 2> /dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2; }
wait_done() {  # wait_done JOB SECONDS: until COMPLETED/FAILED/CANCELLED
  for _ in $(seq 1 $(($2 * 5))); do
    case $(state "$1") in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) return 0 ;; esac
    sleep 0.2
  done
  return 1
}
wait_step() {  # wait_step NAME N: until NAME/ has a checkpoint at step ≥ N
  for _ in $(seq 1 600); do
    local latest
    latest=$(cat "$tmp/$1/latest" 2> /dev/null | tr -dc 0-9)
    [ -n "$latest" ] && [ "$latest" -ge "$2" ] && return 0
    sleep 0.1
  done
  return 1
}
# The losses of every complete metrics line (a torn last one, from a job cancelled mid-write, is
# left out), one "step loss aux" per line; steps must run 1, 2, 3, ... each once.
losses() { python3 -c "
import json, sys
lines = open(sys.argv[1]).read().split('\\n')
for i, l in enumerate(lines):
    if not l: continue
    try: j = json.loads(l)
    except ValueError:
        if i == len(lines) - 1: break
        raise
    if j['step'] != i + 1: sys.exit('%s:%d: step %d, expected %d' % (sys.argv[1], i + 1, j['step'], i + 1))
    print(j['step'], repr(j['loss']), repr(j['aux_loss']))" "$1"; }
last_step() { losses "$1" 2> /dev/null | tail -n 1 | cut -d' ' -f1; }

# 2 first: how far it gets decides how long the uninterrupted run must be. The job trains far
# longer than its three minutes, so the notice comes while it trains. Slurm checks time limits
# periodically (every 30 s, later on a loaded machine), so the notice comes up to a check interval
# early or late; 100 s ahead of the limit leaves room for a late check (with 45 s, a check delayed
# that long on a busy 2-core machine once sent the notice and the cancellation together).
# timelimit_run NAME TIME LEAD: one job of NAME that meets its limit; sets tl_ok, tl_job, resumed.
timelimit_run() {
  config "$1" 100000000 500
  tl_job=$(submit "$1" --time="$2" --signal=B:USR1@"$3")
  tl_ok=0
  for _ in $(seq 1 1800); do  # up to 6 minutes: the first notice, the requeue, the resumed job's steps
    if [ "$(restarts "$tl_job")" -ge 1 ] && grep -q "resumed from" "$1.out"; then
      resumed=$(grep -o "resumed from [^ ]*step_[0-9]*" "$1.out" | tail -n 1 | grep -o "[0-9]*$")
      now=$(last_step "$1/metrics.jsonl")
      [ -n "$resumed" ] && [ -n "$now" ] && [ "$now" -ge $((resumed + 200)) ] && { tl_ok=1; break; }
    fi
    case $(state "$tl_job") in RUNNING | PENDING | REQUEUED | COMPLETING | CONFIGURING) ;; *) break ;; esac
    sleep 0.2
  done
  scancel "$tl_job"
  wait_done "$tl_job" 60 || fail "$1: the job did not stop after scancel: $(state "$tl_job")"
}
tl=timelimit
timelimit_run $tl 3 100
if [ "$tl_ok" != 1 ] && [ "$(restarts "$tl_job")" = 0 ]; then
  # Never requeued: on a loaded machine Slurm's periodic check can come so late that the notice and
  # the limit's cancellation arrive together (seen once in CI, ~99 s late), leaving nothing to
  # requeue. Once more with a wider margin; a template that cannot requeue fails this one too.
  echo "note: $tl was never requeued (Slurm's time-limit check late?); once more with --time=4 --signal=B:USR1@150"
  tail -n 5 $tl.out
  tl=timelimit2
  timelimit_run $tl 4 150
fi
if [ "$tl_ok" = 1 ]; then
  echo "ok: --time limit with --signal=B:USR1: checkpointed at step $resumed at the limit, requeued, resumed ($tl)"
else
  fail "$tl: no requeue and resume within 6 minutes (restarts $(restarts "$tl_job"))"
  tail -n 20 $tl.out
fi
grep -q "time limit near" $tl.out || fail "$tl: the batch shell got no notice"
grep -q "stop requested by signal; checkpointing at step" $tl.out || fail "$tl: the ranks did not checkpoint"
grep -q "checkpoint written; requeueing" $tl.out || fail "$tl: the template did not requeue"
reached=$(last_step $tl/metrics.jsonl)
steps=$(( ${reached:-0} > 2000 ? ${reached:-0} : 2000 ))

# 1. The uninterrupted run, through the template.
config straight "$steps" 100000000
job=$(submit straight)
wait_done "$job" 600 || fail "the straight job did not finish: $(state "$job")"
[ "$(state "$job")" = COMPLETED ] || { fail "the straight job ended $(state "$job")"; tail -n 20 "$tmp/straight.out"; }
grep -q "done at step $steps" straight.out && echo "ok: sbatch of the template trained $steps steps on 2 tasks" \
  || fail "the straight job did not train to step $steps"
losses straight/metrics.jsonl > straight.losses

# compare NAME WHAT: NAME's per-step losses equal the straight run's first ones, bit for bit.
compare() {
  losses "$1/metrics.jsonl" > "$1.losses" || fail "$2: bad metrics"
  local n
  n=$(wc -l < "$1.losses")
  if [ "$n" -gt 0 ] && cmp -s <(head -n "$n" straight.losses) "$1.losses"; then
    echo "ok: $2: every step's loss equals the uninterrupted run's ($n steps)"
  else
    fail "$2: the losses differ from the uninterrupted run's"
    diff <(head -n "$n" straight.losses) "$1.losses" | head -n 6
  fi
}
compare $tl "time limit, requeue, resume"

# 3. A preemption notice by hand, to the ranks: they checkpoint, rank 0 requeues the job, which
#    resumes and completes.
config usr1 2000
job=$(submit usr1)
wait_step usr1 100 || fail "usr1: no checkpoint at step 100"
scancel --signal=USR1 "$job"
for _ in $(seq 1 300); do [ "$(restarts "$job")" -ge 1 ] && break; sleep 0.2; done
wait_done "$job" 300 || fail "usr1: the job did not finish: $(state "$job")"
[ "$(restarts "$job")" -ge 1 ] || fail "usr1: the job was not requeued (restarts $(restarts "$job"))"
grep -q "SIGUSR1 (a preemption notice): requeued Slurm job $job" usr1.out || fail "usr1: the ranks did not requeue the job"
grep -q "resumed from" usr1.out || fail "usr1: the requeued job did not resume"
[ "$(state "$job")" = COMPLETED ] || { fail "usr1: the job ended $(state "$job")"; tail -n 20 usr1.out; }
compare usr1 "scancel --signal=USR1 to the ranks, requeue, resume"

# 4. kill -9 of one task (a rank, not srun): the job fails; scontrol requeue resumes it.
config kill9 2000
job=$(submit kill9)
wait_step kill9 100 || fail "kill9: no checkpoint at step 100"
victim=$(pgrep -f "^$mop train --config $tmp/kill9.yaml" | tail -n 1)
[ -n "$victim" ] || fail "kill9: no rank found"
kill -9 "$victim"
wait_done "$job" 120 || fail "kill9: the job did not end after kill -9 of a task: $(state "$job")"
[ "$(state "$job")" = FAILED ] || fail "kill9: the job ended $(state "$job"), expected FAILED"
before=$(last_step kill9/metrics.jsonl)
scontrol requeue "$job" || fail "kill9: scontrol requeue refused"
for _ in $(seq 1 300); do [ "$(restarts "$job")" -ge 1 ] && break; sleep 0.2; done
wait_done "$job" 300 || fail "kill9: the requeued job did not finish: $(state "$job")"
[ "$(state "$job")" = COMPLETED ] || { fail "kill9: the requeued job ended $(state "$job")"; tail -n 20 kill9.out; }
grep -q "resumed from" kill9.out && echo "ok: kill -9 of rank pid $victim at step ${before:-?}; scontrol requeue resumed from $(grep -o 'resumed from [^ ]*' kill9.out | tail -n 1 | grep -o 'step_[0-9]*')" \
  || fail "kill9: the requeued job did not resume"
compare kill9 "kill -9 of a task, scontrol requeue, resume"

if [ "$failures" != 0 ]; then
  echo "$failures Slurm check(s) failed"
  exit 1
fi
echo "all Slurm checks passed"
