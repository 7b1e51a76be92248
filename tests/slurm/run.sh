#!/usr/bin/env bash
# scripts/slurm/train.sbatch under a real Slurm: a one-node cluster on this machine (its own munge
# and slurm.conf, CPU ranks), and configs/tiny.yaml-sized runs on 2 tasks:
#   1. sbatch of the template trains to the end;
#   2. scancel --batch --signal=USR1 (what --signal=B:USR1@N sends at a time limit) makes the ranks
#      checkpoint, the job requeues itself and resumes; the losses of every step equal an
#      uninterrupted run's, bit for bit.
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
host=$(hostname -s)
port=$((20000 + RANDOM % 20000))
cat > "$tmp/slurm.conf" <<CONF
ClusterName=moptest
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/munge/munge.socket
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
mkdir -p "$tmp/state" "$tmp/spool"
export SLURM_CONF=$tmp/slurm.conf
slurmctld -f "$SLURM_CONF" || { echo "skipped: slurmctld does not start here"; tail -n 5 "$tmp/slurmctld.log"; exit 77; }
slurmd -f "$SLURM_CONF" || { echo "skipped: slurmd does not start here"; tail -n 5 "$tmp/slurmd.log"; exit 77; }
for _ in $(seq 1 100); do sinfo -h -o %t 2> /dev/null | grep -q idle && break; sleep 0.2; done
sinfo -h -o %t | grep -q idle || { echo "skipped: the node does not come up"; tail -n 5 "$tmp/slurmd.log"; exit 77; }
echo "ok: one-node Slurm on $host (port $port)"

# A corpus and a tiny model on 2 CPU ranks (dp 2), a checkpoint every 5 steps.
cd "$tmp"
for i in $(seq 1 400); do echo "line $i of the corpus: the router sends each token to two experts."; done > corpus.txt
"$mop" prepare-data --input corpus.txt --output data/corpus > /dev/null 2>&1 || fail "prepare-data"
steps=${MOP_SLURM_STEPS:-200}
config() {  # config NAME: checkpoints in NAME/
  local n=$steps
  cat > "$tmp/$1.yaml" <<YAML
model: {vocab_size: 257, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2}
moe: {num_experts: 4, top_k: 2, expert_ffn: 32}
data: {paths: [$tmp/data/corpus], seq_len: 64}
train: {steps: $n, global_batch_size: 4, micro_batch_size: 1, device: cpu}
parallel: {attention: {dp: 2}, moe: {dp: 2}}
checkpoint: {dir: $tmp/$1, interval: 5, save_final: true}
log: {interval: 50}
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
losses() { python3 -c "
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l); print(j['step'], repr(j['loss']), repr(j['aux_loss']))" "$1"; }

# The uninterrupted run, through the template.
config straight
job=$(submit straight)
wait_done "$job" 300 || fail "the straight job did not finish: $(state "$job")"
[ "$(state "$job")" = COMPLETED ] || { fail "the straight job ended $(state "$job")"; tail -n 20 "$tmp/straight.out"; }
grep -q "done at step $steps" straight.out && echo "ok: sbatch of the template trained $steps steps on 2 tasks" \
  || fail "the straight job did not train to step $steps"
losses straight/metrics.jsonl > straight.losses

# compare NAME WHAT: NAME's per-step losses equal the straight run's, bit for bit.
compare() {
  losses "$1/metrics.jsonl" > "$1.losses"
  if cmp -s straight.losses "$1.losses"; then
    echo "ok: $2: every step's loss equals the uninterrupted run's ($(wc -l < "$1.losses") steps)"
  else
    fail "$2: the losses differ from the uninterrupted run's"
    diff straight.losses "$1.losses" | head -n 6
  fi
}

# 2. A preemption notice to the batch shell: checkpoint, requeue, resume.
config usr1
job=$(submit usr1)
wait_step usr1 20 || fail "usr1: no checkpoint at step 20"
scancel --batch --signal=USR1 "$job"
wait_done "$job" 300 || fail "usr1: the job did not finish: $(state "$job")"
[ "$(restarts "$job")" -ge 1 ] || fail "usr1: the job was not requeued (restarts $(restarts "$job"))"
grep -q "checkpoint written; requeueing" usr1.out || fail "usr1: the template did not requeue"
grep -q "resumed from" usr1.out || fail "usr1: the requeued job did not resume"
[ "$(state "$job")" = COMPLETED ] || fail "usr1: the job ended $(state "$job")"
compare usr1 "scancel --batch --signal=USR1, requeue, resume"

if [ "$failures" != 0 ]; then
  echo "$failures Slurm check(s) failed"
  exit 1
fi
echo "all Slurm checks passed"
