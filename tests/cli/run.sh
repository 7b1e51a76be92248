#!/usr/bin/env bash
# The command-line contract: bad input of every kind exits with code 2 and one clear message;
# help and version exit 0; a small run trains, checkpoints, resumes and generates.
# Usage: run.sh path/to/mop path/to/source
set -u
mop=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
export OMP_NUM_THREADS=2
failures=0

# expect CODE SUBSTRING -- ARGS...: runs mop, checks the exit code and that the output contains SUBSTRING.
expect() {
  local code=$1 want=$2
  shift 3
  local out rc
  out=$("$mop" "$@" 2>&1)
  rc=$?
  if [ "$rc" != "$code" ] || [[ "$out" != *"$want"* ]]; then
    echo "FAIL: mop $* -> exit $rc (want $code), output:"
    echo "$out" | head -n 20 | sed 's/^/    /'
    echo "    (wanted: $want)"
    failures=$((failures + 1))
  else
    echo "ok: mop $* -> $rc"
  fi
  # User errors are one line.
  if [ "$code" = 2 ] && [ "$(echo "$out" | grep -c '^error:')" != 1 ]; then
    echo "FAIL: mop $*: expected exactly one 'error:' line"
    failures=$((failures + 1))
  fi
}

# A small corpus and a small model.
for i in $(seq 1 400); do echo "line $i of the corpus: the router sends each token to two experts."; [ $((i % 7)) = 0 ] && echo; done > corpus.txt
expect 0 "documents" -- prepare-data --input corpus.txt --output data/corpus --split blank-line
# Random tokens over a real vocabulary (the benchmarks' data), and a run on them.
expect 0 "tokens drawn uniformly from [0, 151936)" -- prepare-data --random-tokens 20000 --vocab-size 151936 --output data/rand
expect 2 "prepare-data --random-tokens needs --vocab-size" -- prepare-data --random-tokens 100 --output data/x
expect 2 "excludes" -- prepare-data --random-tokens 100 --vocab-size 9 --input corpus.txt --output data/x
expect 2 "prepare-data needs --input" -- prepare-data --output data/x
expect 2 "--vocab-size 1: must be in" -- prepare-data --random-tokens 100 --vocab-size 1 --output data/x
# A Hugging Face tokenizer's ids (the Qwen2-form fixture) and its EOS.
expect 0 "vocab 2000, eos 0: train with model.vocab_size ≥ 2000, data.eos_id: 0" -- prepare-data --input corpus.txt --split blank-line --tokenizer "$src/tests/data/fixtures/tokenizer/qwen2/tokenizer.json" --output data/tok
expect 2 "--eos-token </x>: not a token of" -- prepare-data --input corpus.txt --tokenizer "$src/tests/data/fixtures/tokenizer/gpt2/tokenizer.json" --eos-token "</x>" --output data/x
cat > good.yaml <<'EOF'
model: {vocab_size: 257, hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 4, top_k: 2, expert_ffn: 16}
data: {paths: [data/corpus], seq_len: 32}
train: {steps: 4, global_batch_size: 4, micro_batch_size: 2}
checkpoint: {dir: ckpt, resume: auto}
log: {interval: 2}
EOF

# Usage.
expect 0 "Examples" -- --help
# A subcommand's help lists its own examples and its options' defaults, not mop's whole list.
out=$("$mop" generate --help 2>&1)
if [[ "$out" == *"mop generate --checkpoint"* ]] && [[ "$out" != *"mop train --config"* ]] && [[ "$out" == *"=200"* ]] \
  && [[ "$out" == *"=0.8"* ]] && [[ "$out" == *"=40"* ]] && [[ "$("$mop" plan --help 2>&1)" == *"=10"* ]]; then
  echo "ok: mop generate --help: its examples and defaults"
else
  echo "FAIL: mop generate --help repeats every example or lacks a default:"; echo "$out" | sed 's/^/    /'
  failures=$((failures + 1))
fi
# docs/commands.md names every option of every command (plan --program/--rank, train --profile-step, ...).
for cmd in train validate plan calibrate emulate prepare-data generate import-hf export-hf score; do
  "$mop" "$cmd" --help 2>&1 | python3 -c "
import re, sys
rows = [l for l in open('$src/docs/commands.md', encoding='utf-8') if l.startswith('| \`mop $cmd ')]
missing = []
for line in sys.stdin:
    m = re.match(r'^  (-\w,)?(--[\w-]+)', line)
    if m and m.group(2) != '--help' and not any(m.group(2) in r or (m.group(1) and m.group(1)[:-1] + ' ' in r) for r in rows):
        missing.append(m.group(2))
sys.exit('docs/commands.md misses mop $cmd ' + ', '.join(missing) if missing else 0)" \
    || failures=$((failures + 1))
done
expect 0 "mop 0." -- --version
expect 2 "error:" --
expect 2 "error:" -- frobnicate
expect 2 "error:" -- train --config good.yaml --bogus-flag
expect 2 "--config is required" -- train

# Config problems.
expect 2 "config file missing.yaml: not found" -- train --config missing.yaml
expect 2 "unknown command 'trian' (did you mean train?)" -- trian --config good.yaml
mkdir -p a_directory
expect 2 "config file a_directory is a directory" -- train --config a_directory
# Files read whole: stat first (a FIFO is refused, not waited on), and a cap on the size.
mkfifo a_fifo.yaml
expect 2 "config file a_fifo.yaml: is not a regular file (a FIFO)" -- validate --config a_fifo.yaml
expect 2 "config file /dev/zero: is not a regular file (a character device)" -- validate --config /dev/zero
truncate -s 65M huge.yaml
expect 2 "config file huge.yaml: 65 MiB, over the 64 MiB cap for this file" -- validate --config huge.yaml
printf 'model: {hidden_size: 16, num_layers: 2, hidden_size: 32}\n' > dup_key.yaml
expect 2 "dup_key.yaml:1: duplicate key model.hidden_size" -- validate --config dup_key.yaml
printf 'train: {steps: 2}\nmodel: {hidden_size: 16}\ntrain: {steps: 3}\n' > dup_section.yaml
expect 2 "dup_section.yaml:3: duplicate key train (first given on line 1)" -- validate --config dup_section.yaml
printf 'model:\n  hidden_size: [1, 2\n' > bad_yaml.yaml
expect 2 "malformed YAML" -- validate --config bad_yaml.yaml
expect 2 "--set moe.topk: unknown key (did you mean moe.top_k?)" -- validate --config good.yaml --set moe.topk=2
expect 2 "moe.top_k: 9 exceeds moe.num_experts (4)" -- validate --config good.yaml --set moe.top_k=9
# PyTorch's device name: gpu is cuda here, not cpu.
expect 2 "'gpu' is not one of auto, cpu or cuda (did you mean cuda?)" -- train --config good.yaml --set train.device=gpu
expect 2 "model.hidden_size: expected an integer, got 'big'" -- validate --config good.yaml --set model.hidden_size=big
# User text echoed in an error has its control characters escaped: a value cannot clear the terminal.
expect 2 "model.hidden_size: expected an integer, got '\\x1b[2J'" -- validate --config good.yaml --set $'model.hidden_size=\e[2J'
expect 2 "unknown command 'x\\x1b[2J'" -- $'x\e[2J'
no_raw_escape() {
  [[ "$("$mop" "$@" 2>&1)" != *$'\e'* ]] || { echo "FAIL: mop $* echoed a raw escape character"; failures=$((failures + 1)); }
}
no_raw_escape validate --config good.yaml --set $'model.hidden_size=\e[2J'
no_raw_escape validate --config $'\e[2J.yaml'
no_raw_escape $'x\e[2J'
no_raw_escape train --config good.yaml --set $'data.paths=[data/\e[2J]'
expect 2 "model.num_kv_heads: 3 does not divide model.num_heads (2)" -- validate --config good.yaml --set model.num_kv_heads=3
expect 2 "model.hidden_size: -1 is out of range" -- validate --config good.yaml --set model.hidden_size=-1
expect 2 "train.global_batch_size: 3 is not a multiple" -- validate --config good.yaml --set train.global_batch_size=3
expect 0 "config OK" -- validate --config good.yaml
expect 0 "active per token" -- validate --config good.yaml

# Data problems.
expect 2 "data/nothing" -- train --config good.yaml --set 'data.paths=[data/nothing]'
head -c 100 data/corpus.idx > data/trunc.idx && cp data/corpus.bin data/trunc.bin
expect 2 "data/trunc.idx" -- train --config good.yaml --set 'data.paths=[data/trunc]'
printf 'MMIDIDX\x00\x00' > data/magic.idx && head -c 200 /dev/zero >> data/magic.idx && cp data/corpus.bin data/magic.bin
expect 2 "data/magic.idx" -- train --config good.yaml --set 'data.paths=[data/magic]'
mkfifo data/fifo.idx && cp data/corpus.bin data/fifo.bin
expect 2 "data/fifo.idx: is not a regular file (a FIFO)" -- train --config good.yaml --set 'data.paths=[data/fifo]'
python3 -c "import struct,sys; sys.stdout.buffer.write(struct.pack('<600H', *([65]*300 + [300] + [66]*299)))" > data/flat.bin
expect 2 "is outside the vocabulary" -- train --config good.yaml --set 'data.paths=[data/flat.bin]' --set data.format=flat --set data.eos_id=-1
expect 2 "is outside the vocabulary" -- validate --config good.yaml --set 'data.paths=[data/flat.bin]' --set data.format=flat --set data.eos_id=-1 --scan-data
head -c 21 data/flat.bin > data/odd.bin
expect 2 "data/odd.bin" -- train --config good.yaml --set 'data.paths=[data/odd.bin]' --set data.format=flat
expect 2 "seq_len" -- train --config good.yaml --set data.seq_len=100000
expect 2 "no training data" -- train --config good.yaml --set 'data.paths=[]'
expect 2 "corpus-missing.txt" -- prepare-data --input corpus-missing.txt --output data/x
expect 2 "train.device: cuda" -- train --config good.yaml --set train.device=cuda

# The plan: per component, memory and time; the search; JSON; machine files; train.plan: auto.
expect 0 "MFU" -- plan --config good.yaml
expect 0 "MFU" -- plan --config "$src/configs/q3moe-8l.yaml"
expect 0 "the best plan" -- plan --config "$src/configs/q3moe-8l.yaml" --gpus 8 --search --top 3
"$mop" plan --config "$src/configs/q3moe-8l.yaml" --json > plan.json 2>&1
python3 -c "import json,sys; d=json.load(open('plan.json')); sys.exit(0 if d['time']['step'] > 0 and d['memory']['device_total'] > 0 else 1)" \
  || { echo "FAIL: mop plan --json is not a plan"; failures=$((failures + 1)); }
# The step program: rank 0's by default, another rank's with --rank, refused for a rank outside the plan.
expect 0 "device-update   seg [3,4)" -- plan --config good.yaml --program
expect 0 "grads-to-host" -- plan --config good.yaml --set parallel.attention.dp=2 --set parallel.moe.dp=2 --set optim.state_placement=host --program --rank 1
expect 2 "--rank 2: the plan has 2 rank(s), 0 to 1" -- plan --config good.yaml --set parallel.attention.dp=2 --set parallel.moe.dp=2 --program --rank 2
expect 2 "The largest is the activations; to fit" -- plan --config "$src/configs/q3moe-8l.yaml" --set data.seq_len=131072 --set train.global_batch_size=1
expect 0 "slicing saves" -- plan --config "$src/configs/moe-1t.yaml" --machine "$src/configs/machines/h200-12-nodes.yaml" --search --top 1
expect 2 "no plan fits" -- plan --config "$src/configs/moe-1t.yaml" --machine "$src/configs/machines/h200-12-nodes.yaml" --gpus 16 --search --top 1
# --gpus N with no layout in the config: the plan lays the ranks out (as --search and train.plan: auto).
q3="$src/configs/q3moe-8l.yaml"
expect 0 "layout for 8 ranks: the config's foldings make 1, so the plan chose" -- plan --config "$q3" --gpus 8
expect 0 "layout for 16 ranks" -- plan --config "$q3" --gpus 16 --nodes 2
expect 0 "layout for 8 ranks" -- plan --config "$q3" --machine "$src/configs/machines/h200-1-node.yaml" --nodes 1
expect 0 "layout for 4 ranks" -- emulate --config good.yaml --set train.device=cpu --gpus 4 --steps 2
# A machine file and no --gpus: every GPU of it, said so.
expect 0 "8 ranks: every GPU of $src/configs/machines/h200-1-node.yaml" -- plan --config "$q3" --machine "$src/configs/machines/h200-1-node.yaml"
# No plan fits: what would (fewer or more GPUs, a batch that divides over the ranks).
expect 2 "one fits with --gpus 8, --gpus 16 --nodes 2, or with 12 ranks and train.global_batch_size 9 (or 6) in place of 8: --set train.global_batch_size=9" -- plan --config "$q3" --gpus 12 --search
# The search's table: columns that line up, '#' for the ranking, figures grouped, equal times by memory.
"$mop" plan --config "$q3" --gpus 8 --search --top 12 > search.txt 2>&1
python3 - search.txt <<'PY' || { echo "FAIL: mop plan --search's table"; sed 's/^/    /' search.txt | head -20; failures=$((failures + 1)); }
import re, sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
head = next(i for i, l in enumerate(lines) if re.match(r"^ +# +settings ", l))
table = lines[head:lines.index("", head)]
assert len(table) == 13 and len({len(l) for l in table}) == 1, table
assert all(re.search(r" \d{1,3}(,\d{3})+ ", l) for l in table[1:]), table
PY
"$mop" plan --config "$q3" --gpus 8 --search --top 100 --json > search.json 2>&1
python3 -c "
import json, sys
f = json.load(open('search.json'))['feasible']
bad = [(a['settings'], b['settings']) for a, b in zip(f, f[1:])
       if a['time']['step'] == b['time']['step'] and a['memory']['device_total'] > b['memory']['device_total']]
sys.exit('equal-time plans with more memory first: %s' % bad[:2] if bad else 0)" || failures=$((failures + 1))
expect 0 "tokens/s" -- plan --config "$q3"
[[ "$("$mop" plan --config "$q3" 2>&1)" =~ [0-9],[0-9]{3}\ tokens/s ]] \
  || { echo "FAIL: mop plan prints tokens/s without digit grouping"; failures=$((failures + 1)); }
# validate takes the job's ranks and refuses a plan that does not fit (exit 2, what would fit).
expect 2 "no plan fits h200 with 1 rank(s)" -- validate --config "$src/configs/moe-1t.yaml" --set 'data.paths=[]'
expect 2 "one fits with --gpus 96 --nodes 12" -- validate --config "$src/configs/moe-1t.yaml" --set 'data.paths=[]'
expect 2 "the plan needs 37.02 TiB" -- validate --config "$src/configs/moe-1t.yaml" --set 'data.paths=[]' --set train.plan=config
expect 0 "config OK" -- validate --config "$src/configs/moe-1t.yaml" --set 'data.paths=[]' --gpus 96 --nodes 12
expect 0 "ranks: 2 (attention cp 1 × dp 2" -- validate --config good.yaml --gpus 2 --set train.device=cpu
expect 2 "optim.gradients: host streams the gradients" -- plan --config good.yaml --set optim.gradients=host --set optim.state_placement=gpu
expect 0 "stash-grads" -- plan --config good.yaml --set optim.gradients=host --set optim.state_placement=host --program
expect 0 "reduce-scatter" -- plan --config good.yaml --set parallel.shard=slice --set parallel.attention.dp=2 --set parallel.moe.dp=2 --program
# The plan's host budget is the process's own limits too: under ulimit -v a run too large for it is
# refused by the plan (exit 2) instead of dying at its first allocation.
cat > big.yaml <<'EOF'
model: {vocab_size: 257, hidden_size: 1024, num_layers: 8, num_heads: 8, num_kv_heads: 4}
moe: {num_experts: 32, top_k: 2, expert_ffn: 1024}
data: {paths: [data/corpus], seq_len: 32}
train: {steps: 1, global_batch_size: 2, micro_batch_size: 2, device: cpu}
checkpoint: {dir: ckpt_big}
EOF
out=$( (ulimit -v 3000000; "$mop" train --config big.yaml) 2>&1); rc=$?
if [ "$rc" = 2 ] && [[ "$out" == *"host memory per node"* ]] && [[ "$out" == *"by this process's limits"* ]]; then
  echo "ok: mop train under ulimit -v -> 2"
else
  echo "FAIL: mop train under ulimit -v -> exit $rc (want 2, the plan's refusal), output:"; echo "$out" | tail -n 5
  failures=$((failures + 1))
fi
expect 0 "wrote machine.yaml" -- calibrate --device cpu --out machine.yaml
# mop emulate: one rank of a 4-rank CPU job, its collectives stand-ins; JSON; skewed routing runs the
# most-loaded rank too; a router histogram from a real run; bad input; a job that does not fit.
E="--config good.yaml --set train.device=cpu --set parallel.attention.dp=2 --set parallel.attention.cp=2 --set parallel.moe.ep=2 --set parallel.moe.dp=2 --gpus 4 --steps 2"
expect 0 "composed" -- emulate $E --rank 3
expect 0 "the most-loaded rank, 0" -- emulate $E --rank 1 --routing zipf:1.5
# A pipeline stage's rank; under a skewed routing the most-loaded rank of the same stage.
P="--config good.yaml --set train.device=cpu --set parallel.pp=2 --set parallel.attention.dp=2 --set parallel.moe.ep=2 --gpus 4 --steps 2"
expect 0 "pipeline stage 1 of 2 (segments 2–3)" -- emulate $P --rank 3
expect 0 "the most-loaded rank, 2" -- emulate $P --rank 3 --routing zipf:1.5
"$mop" emulate $E --layers 1 --json > emulate.json 2> emulate.log
python3 -c "
import json, sys
d = json.load(open('emulate.json'))
r = d['ranks'][0]
ok = d['world'] == 4 and d['layers'] == 1 and 'plan_full_depth' in d and r['memory']['device_allocated_gib'] == r['memory']['device_planned_gib'] and r['step_composed_ms'] > 0
sys.exit(0 if ok else 1)" || { echo "FAIL: mop emulate --json"; cat emulate.json | head -20; failures=$((failures + 1)); }
expect 0 "done at step 2" -- train --config good.yaml --set train.steps=2 --set checkpoint.dir=ckpt_hist --set log.router_histogram=hist.json
expect 0 "router histogram hist.json" -- emulate $E --routing hist.json
# --trace: a Chrome trace of the emulated rank's last step (rank 3 here, not the root), with its
# ops on the compute stream; a path it cannot write is refused before the run.
"$mop" emulate $E --rank 3 --trace emulate_trace.json > /dev/null 2>&1
python3 -c "
import json, sys
d = json.load(open('emulate_trace.json'))
ev = d['traceEvents'] if isinstance(d, dict) else d
names = {e.get('name') for e in ev}
sys.exit(0 if 'grouped_gemm_fwd' in names and 'attention_fwd' in names else 1)" ||
  { echo "FAIL: mop emulate --trace"; failures=$((failures + 1)); }
expect 2 "--trace no-such-dir/t.json: cannot write to it" -- emulate $E --trace no-such-dir/t.json
expect 2 "--rank 4: the job has 4 rank(s)" -- emulate $E --rank 4
expect 2 "zipf:S" -- emulate $E --routing zipf:x
expect 2 "--layers 3: 1 to 2" -- emulate $E --layers 3
expect 2 "no plan fits cpu with 3 rank(s) (378 plans: 378 invalid settings, e.g." -- emulate --config good.yaml --set train.device=cpu --gpus 3
out=$( (ulimit -v 3000000; "$mop" emulate --config big.yaml --gpus 1) 2>&1); rc=$?
if [ "$rc" = 2 ] && [[ "$out" == *"memory"* ]]; then
  echo "ok: mop emulate of a job too large for this process -> 2"
else
  echo "FAIL: mop emulate under ulimit -v -> exit $rc (want 2), output:"; echo "$out" | tail -n 5
  failures=$((failures + 1))
fi
expect 0 "in-step factors from good.yaml" -- calibrate --device cpu --out machine_step.yaml --step good.yaml --set train.device=cpu
grep -q "in_step_attention" machine_step.yaml || { echo "FAIL: calibrate --step wrote no in-step factors"; failures=$((failures + 1)); }
expect 0 "MFU" -- plan --config good.yaml --machine machine.yaml --set train.device=cpu
printf 'device: {memroy_gib: 1}\n' > bad_machine.yaml
expect 2 "bad_machine.yaml:1: device.memroy_gib: unknown key" -- plan --config good.yaml --machine bad_machine.yaml
expect 2 "machine file nowhere.yaml: not found" -- plan --config good.yaml --machine nowhere.yaml
expect 2 "'sometimes' is not one of config or auto" -- plan --config good.yaml --set train.plan=sometimes
expect 0 "done at step 2" -- train --config good.yaml --set train.plan=auto --set train.steps=2 --set checkpoint.dir=ckpt_auto
# validate and plan describe the run mop train does on this machine (the CPU where it has no GPU).
trained_on=$("$mop" train --config good.yaml --set train.steps=1 --set checkpoint.dir=ckpt_device 2>&1 | sed -n 's/.*active per token) | \([a-z]*\), .*/\1/p')
expect 0 "step on ${trained_on:-?}," -- validate --config "$src/configs/tiny.yaml" --set 'data.paths=[data/corpus]'
expect 0 "step on ${trained_on:-?}," -- plan --config "$src/configs/tiny.yaml"
if [ "$trained_on" = cpu ]; then
  expect 0 "this machine has no GPU, so mop train runs this config here on the CPU" -- plan --config "$src/configs/tiny.yaml"
fi
# A layout of two ranks in one process: how to start it, and no checkpoint directory left behind.
expect 2 "mop train runs as one process: start one per rank, e.g. mpirun -np 2 mop train --config good.yaml" -- train --config good.yaml --set parallel.attention.dp=2 --set checkpoint.dir=ckpt_np2
expect 2 "data/nothing" -- train --config good.yaml --set 'data.paths=[data/nothing]' --set checkpoint.dir=ckpt_failed
[ ! -e ckpt_np2 ] && [ ! -e ckpt_failed ] \
  || { echo "FAIL: a start that failed left $(ls -d ckpt_np2 ckpt_failed 2> /dev/null)"; failures=$((failures + 1)); }
expect 0 "done at step 2" -- train --config good.yaml --set model.vocab_size=151936 --set "data.paths=[data/rand]" --set data.eos_id=-1 --set train.steps=2 --set checkpoint.dir=ckpt_rand
grep -q 'plan: "config"' ckpt_auto/config.resolved.yaml \
  || { echo "FAIL: train.plan: auto did not write the chosen plan into config.resolved.yaml"; failures=$((failures + 1)); }

# Train, checkpoint, resume, generate.
expect 0 "done at step 4" -- train --config good.yaml
test -f ckpt/step_4/manifest.json || { echo "FAIL: no checkpoint written"; failures=$((failures + 1)); }
# Asked again after its last step (a requeue loop): complete, exit 0.
expect 0 "is at step 4 of train.steps 4: the run is complete, nothing to train" -- train --config good.yaml
expect 0 "resumed from" -- train --config good.yaml --set train.steps=6
# A run refused after its start-up (data it cannot read at the first step) leaves the directory's
# config.resolved.yaml as it was; it is written once a step has run.
mkdir -p ckpt_refused && echo "an earlier run's" > ckpt_refused/config.resolved.yaml
expect 2 "is outside the vocabulary" -- train --config good.yaml --set checkpoint.dir=ckpt_refused --set 'data.paths=[data/flat.bin]' --set data.format=flat --set data.eos_id=-1
[ "$(cat ckpt_refused/config.resolved.yaml)" = "an earlier run's" ] \
  || { echo "FAIL: a refused run rewrote config.resolved.yaml"; failures=$((failures + 1)); }
# metrics.jsonl: a torn last line (a crash in mid-write) is dropped on resume; a malformed line
# before it stops the resume, named; a metrics file that cannot be written stops the run.
printf '{"step": 7, "lo' >> ckpt/metrics.jsonl
expect 0 "dropping a torn last line" -- train --config good.yaml --set train.steps=7
python3 -c "import json; [json.loads(l) for l in open('ckpt/metrics.jsonl')]" \
  || { echo "FAIL: metrics.jsonl is not JSON lines after a resume over a torn line"; failures=$((failures + 1)); }
sed -i '2s/.*/garbage/' ckpt/metrics.jsonl
expect 2 "ckpt/metrics.jsonl:2: not a metrics line" -- train --config good.yaml --set train.steps=8
sed -i '2d' ckpt/metrics.jsonl
expect 2 "log.metrics_file: writing /dev/full failed" -- train --config good.yaml --set train.steps=2 --set checkpoint.dir=ckpt_full --set log.metrics_file=/dev/full
expect 2 "model.hidden_size 16 → 32" -- train --config good.yaml --set train.steps=8 --set model.hidden_size=32
# A resume refuses model changes that keep every shape (they would change what the run trains),
# naming them; checkpoint.init_from starts a new run from the weights on purpose.
expect 2 "model.qk_norm true → false" -- train --config good.yaml --set train.steps=8 --set model.qk_norm=false
expect 2 "moe.top_k 2 → 1, moe.aux_loss_coef" -- train --config good.yaml --set train.steps=8 --set moe.top_k=1 --set moe.aux_loss_coef=0.5
expect 2 "set checkpoint.init_from: ckpt/step_" -- train --config good.yaml --set train.steps=8 --set model.rope_theta=5000
expect 0 "with model changes: model.qk_norm true → false, moe.top_k 2 → 1" -- train --config good.yaml --set checkpoint.dir=ckpt_ft --set checkpoint.init_from=ckpt --set model.qk_norm=false --set moe.top_k=1 --set train.steps=2
test -d ckpt_ft/step_2 || { echo "FAIL: the init_from run did not train from step 0 to 2"; failures=$((failures + 1)); }
expect 2 "checkpoint.init_from: nowhere" -- train --config good.yaml --set checkpoint.dir=ckpt_ft2 --set checkpoint.init_from=nowhere --set train.steps=2
expect 2 "checkpoint ckpt/step_999: not found" -- train --config good.yaml --set train.steps=8 --resume ckpt/step_999
mkdir -p ckpt/step_50
expect 2 "no manifest.json" -- train --config good.yaml --set train.steps=8 --resume ckpt/step_50
expect 0 "wrote" -- train --config good.yaml --set train.steps=2 --set checkpoint.dir=ckpt_trace --set optim.state_placement=host --profile-step 2
python3 -c "import json,sys; d=json.load(open('ckpt_trace/trace_step_2.json')); sys.exit(0 if len(d['traceEvents']) > 10 else 1)" \
  || { echo "FAIL: the Chrome trace is not valid JSON with events"; failures=$((failures + 1)); }
expect 0 "line" -- generate --checkpoint ckpt --prompt "line 1" --tokens 20 --temperature 0
expect 2 "no checkpoint found" -- generate --checkpoint nowhere --prompt x

# SIGUSR1 (Slurm's preemption notice), SIGTERM and SIGINT stop training at the next step with a
# checkpoint, exit 0, and the next run resumes from it.
for sig in USR1 TERM INT; do
  "$mop" train --config good.yaml --set train.steps=100000000 --set checkpoint.dir="ckpt_$sig" \
    --set log.interval=1 > "sig_$sig.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -qE 'step +[0-9]+/' "sig_$sig.log" && break; sleep 0.1; done
  kill -"$sig" "$pid"
  wait "$pid"
  rc=$?
  if [ "$rc" != 0 ] || ! grep -q "stop requested by signal" "sig_$sig.log" || [ ! -e "ckpt_$sig/latest" ]; then
    echo "FAIL: SIG$sig did not checkpoint and exit 0 (exit $rc):"
    tail -n 5 "sig_$sig.log" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok: SIG$sig checkpointed and exited 0"
  fi
done
expect 0 "resumed from" -- train --config good.yaml --set train.steps=100000000 --set checkpoint.dir=ckpt_USR1 --set train.exit_interval=1

# One run per checkpoint directory: a second is refused, naming the first; the lock file of a run
# killed with -9 is taken over; a fresh start (resume: none) does not replace another run unless
# checkpoint.overwrite says so, and then the earlier checkpoints go once the new run has started.
"$mop" train --config good.yaml --set train.steps=100000000 --set checkpoint.dir=ckpt_lock \
  --set log.interval=1 > lock_first.log 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -qE 'step +[0-9]+/' lock_first.log && break; sleep 0.1; done
expect 2 "checkpoint.dir ckpt_lock is in use by another run (host" -- train --config good.yaml --set checkpoint.dir=ckpt_lock
kill -TERM "$pid"
wait "$pid"
printf 'host elsewhere pid 999999\n' > ckpt_lock/.lock
expect 0 "taking over the lock of a run that is gone (host elsewhere pid 999999)" -- train --config good.yaml --set checkpoint.dir=ckpt_lock --set train.steps=100000000 --set train.exit_interval=1
test -s ckpt_lock/.lock && { echo "FAIL: a run that ended left its lock file filled"; failures=$((failures + 1)); }
expect 2 "checkpoint.dir ckpt_lock already holds a run" -- train --config good.yaml --set checkpoint.dir=ckpt_lock --set checkpoint.resume=none --set train.steps=2
expect 0 "removing the earlier run's" -- train --config good.yaml --set checkpoint.dir=ckpt_lock --set checkpoint.resume=none --set checkpoint.overwrite=true --set train.steps=2
[ "$(ls -d ckpt_lock/step_* | tr '\n' ' ')" = "ckpt_lock/step_2 " ] \
  || { echo "FAIL: checkpoint.overwrite left $(ls -d ckpt_lock/step_*)"; failures=$((failures + 1)); }

# Hugging Face interop and scoring: bad input exits 2 with the problem named; a small round trip.
expect 2 "import-hf: hf-missing: not a directory" -- import-hf hf-missing --out ckpt_hf
mkdir -p hf_bad
expect 2 "no config.json" -- import-hf hf_bad --out ckpt_hf
echo '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}' > hf_bad/config.json
expect 2 'model_type = "llama": mop imports' -- import-hf hf_bad --out ckpt_hf
echo '{"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 1000000000000}' > hf_bad/config.json
expect 2 "config.json: num_hidden_layers = 1000000000000 is out of range: it becomes mop's model.num_layers, which takes 1 to 4096" -- import-hf hf_bad --out ckpt_hf
expect 2 "no checkpoint found" -- export-hf nowhere --out hf_out
expect 2 "--dtype" -- export-hf ckpt --out hf_out --dtype fp16
expect 2 "MixtralForCausalLM has no q/k norm" -- export-hf ckpt --out hf_out --arch mixtral
expect 2 "'5XB' is not a size" -- export-hf ckpt --out hf_out --max-shard-size 5XB
printf '1 2 999\n' > tokens_bad.txt
expect 2 "token 999 at position 2 of sequence 1 is outside the vocabulary" -- score --checkpoint ckpt --tokens tokens_bad.txt
expect 2 "tokens-missing.txt: not found" -- score --checkpoint ckpt --tokens tokens-missing.txt
printf '108 105 110 101 32 49\n76 73 78 69\n' > tokens.txt
expect 0 "mean cross-entropy" -- score --checkpoint ckpt --tokens tokens.txt --out logits.bin
expect 0 "exported" -- export-hf ckpt --out hf_out --max-shard-size 20KB
expect 0 "imported Qwen3MoeForCausalLM" -- import-hf hf_out --out ckpt_hf
# import-hf: the YAML alone on stdout, the init_from hint; export-hf gives back the context length.
expect 0 "checkpoint.init_from: ckpt_golden" -- import-hf "$src/tests/hf/golden/qwen3_moe" --out ckpt_golden
"$mop" import-hf "$src/tests/hf/golden/qwen3_moe" --out ckpt_golden2 > golden.yaml 2> /dev/null
if grep -qvE '^(#|model:$|moe:$|data:$|  )' golden.yaml || ! grep -q '^  max_position_embeddings: 128$' golden.yaml; then
  echo "FAIL: import-hf's stdout is not the model YAML alone:"; head -n 5 golden.yaml | sed 's/^/    /'
  failures=$((failures + 1))
fi
expect 0 "exported" -- export-hf ckpt_golden --out hf_golden
grep -q '"max_position_embeddings": 128,' hf_golden/config.json \
  || { echo "FAIL: export-hf did not give back max_position_embeddings 128"; failures=$((failures + 1)); }
expect 2 "already holds checkpoints" -- import-hf hf_out --out ckpt_hf
expect 2 "already holds a model" -- export-hf ckpt --out hf_out

# Text for score: a byte-level model reads it as bytes, the same numbers as its ids.
printf 'line 1\nLINE\n' > text.txt
cross_entropy() { "$mop" score "$@" 2>&1 | grep "mean cross-entropy"; }
[ -n "$(cross_entropy --checkpoint ckpt --tokens tokens.txt)" ] \
  && [ "$(cross_entropy --checkpoint ckpt --tokens tokens.txt)" = "$(cross_entropy --checkpoint ckpt --text text.txt)" ] \
  || { echo "FAIL: score --text of a byte-level model differs from --tokens of the bytes"; failures=$((failures + 1)); }
expect 2 "--tokens excludes --text" -- score --checkpoint ckpt --tokens tokens.txt --text text.txt
# A sequence too long for the memory this process may use: refused before the model allocates it.
head -c 2000000 /dev/zero | tr '\0' 'a' > long_line.txt
out=$( (ulimit -v 2500000; "$mop" score --checkpoint ckpt --text long_line.txt --out long.bin) 2>&1); rc=$?
if [ "$rc" = 2 ] && [[ "$out" == *"score: the longest sequence: 2000000 tokens need"* ]] && [[ "$out" == *"use shorter sequences"* ]]; then
  echo "ok: mop score of a 2M-token line under ulimit -v -> 2"
else
  echo "FAIL: mop score of a 2M-token line under ulimit -v -> exit $rc (want 2), output:"; echo "$out" | tail -n 5
  failures=$((failures + 1))
fi
expect 2 "mop score needs one of --tokens (ids) and --text (text)" -- score --checkpoint ckpt
expect 2 "--text nowhere.txt: not found" -- score --checkpoint ckpt --text nowhere.txt
expect 2 "--tokens a_fifo.yaml: is not a regular file (a FIFO)" -- score --checkpoint ckpt --tokens a_fifo.yaml
expect 2 "--text /dev/zero: is not a regular file (a character device)" -- score --checkpoint ckpt --text /dev/zero

# The tokenizer goes with the data into every checkpoint: generate and score read text with it,
# export-hf and import-hf carry it; a run whose data and checkpoint disagree is refused.
qtok="$src/tests/data/fixtures/tokenizer/qwen2/tokenizer.json"
gtok="$src/tests/data/fixtures/tokenizer/gpt2/tokenizer.json"
check_same() {  # check_same FILE1 FILE2 WHAT
  cmp -s "$1" "$2" || { echo "FAIL: $3 ($2 is not $1)"; failures=$((failures + 1)); }
}
check_same "$qtok" data/tok.tokenizer.json "prepare-data --tokenizer did not write the tokenizer beside the shards"
cat > tok.yaml <<'CONF'
model: {vocab_size: 2048, hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 4, top_k: 2, expert_ffn: 16}
data: {paths: [data/tok], seq_len: 32, eos_id: 0}
train: {steps: 3, global_batch_size: 4, micro_batch_size: 2}
checkpoint: {dir: ckpt_tok}
CONF
expect 0 "done at step 3" -- train --config tok.yaml
check_same "$qtok" ckpt_tok/step_3/tokenizer.json "the checkpoint does not carry the data's tokenizer"
grep -q '"tokenizer.json"' ckpt_tok/step_3/manifest.json \
  || { echo "FAIL: the manifest does not list tokenizer.json"; failures=$((failures + 1)); }
expect 0 "line 1 of" -- generate --checkpoint ckpt_tok --prompt "line 1 of" --tokens 8 --temperature 0
# score --text equals score --tokens of the ids prepare-data wrote for the same text.
printf "line 5 of the corpus: the router sends each token to two experts." > held.txt  # no newline
expect 0 "documents" -- prepare-data --input held.txt --tokenizer "$qtok" --output data/held
python3 -c "
import struct
b = open('data/held.bin', 'rb').read()
ids = struct.unpack('<%dH' % (len(b) // 2), b)
assert ids[-1] == 0, ids  # the end-of-document token
print(' '.join(map(str, ids[:-1])))" > held_ids.txt
[ -n "$(cross_entropy --checkpoint ckpt_tok --tokens held_ids.txt)" ] \
  && [ "$(cross_entropy --checkpoint ckpt_tok --tokens held_ids.txt)" = "$(cross_entropy --checkpoint ckpt_tok --text held.txt)" ] \
  || { echo "FAIL: score --text with the checkpoint's tokenizer differs from --tokens of its ids"; failures=$((failures + 1)); }
expect 2 "has 2000 ids, more than model.vocab_size 1024" -- train --config tok.yaml --set model.vocab_size=1024 --set checkpoint.dir=ckpt_tok_small
expect 2 "was made with a tokenizer" -- train --config tok.yaml --set "data.paths=[data/tok, data/corpus]" --set checkpoint.dir=ckpt_tok_mixed
expect 0 "documents" -- prepare-data --input corpus.txt --split blank-line --tokenizer "$gtok" --output data/tok_gpt2
expect 2 "differs from the one checkpoint" -- train --config tok.yaml --set "data.paths=[data/tok_gpt2]" --set checkpoint.dir=ckpt_tok_ft --set checkpoint.init_from=ckpt_tok
expect 0 "done at step 3" -- train --config tok.yaml --set "data.paths=[data/tok_gpt2]" --set checkpoint.dir=ckpt_tok_ft --set checkpoint.init_from=ckpt_tok --set "data.tokenizer=$gtok"
check_same "$gtok" ckpt_tok_ft/step_3/tokenizer.json "data.tokenizer is not the one the checkpoints carry"
expect 2 "data.tokenizer nowhere.json: not found" -- train --config tok.yaml --set data.tokenizer=nowhere.json --set checkpoint.dir=ckpt_tok_none
expect 2 "data.tokenizer a_directory: is not a regular file (a directory)" -- train --config tok.yaml --set data.tokenizer=a_directory --set checkpoint.dir=ckpt_tok_none
# Shards rewritten as bytes lose the tokenizer an earlier prepare left beside them.
expect 0 "documents" -- prepare-data --input corpus.txt --output data/tok_gpt2
[ ! -e data/tok_gpt2.tokenizer.json ] \
  || { echo "FAIL: byte-level shards kept an earlier tokenizer beside them"; failures=$((failures + 1)); }
# Hugging Face directories get the tokenizer and give it back; init_from keeps it.
expect 0 "config.json and the tokenizer" -- export-hf ckpt_tok --out hf_tok
check_same "$qtok" hf_tok/tokenizer.json "export-hf did not write the tokenizer"
expect 0 "tokenizer copied from hf_tok/tokenizer.json" -- import-hf hf_tok --out ckpt_tok_hf
check_same "$qtok" ckpt_tok_hf/step_0/tokenizer.json "import-hf did not carry the tokenizer"
expect 0 "tokens drawn uniformly" -- prepare-data --random-tokens 5000 --vocab-size 2000 --output data/rand2k
expect 0 "done at step 2" -- train --config tok.yaml --set "data.paths=[data/rand2k]" --set data.eos_id=-1 --set checkpoint.dir=ckpt_tok_rand --set checkpoint.init_from=ckpt_tok_hf --set train.steps=2
check_same "$qtok" ckpt_tok_rand/step_2/tokenizer.json "a run on untokenized data from a checkpoint with a tokenizer dropped it"

# docs/configuration.md's table is the generated reference, line for line.
"$mop" config-reference > reference.md
missing=$(grep -vxF -f "$src/docs/configuration.md" reference.md | head -n 3)
if [ -n "$missing" ]; then
  echo "FAIL: docs/configuration.md's table is out of date (regenerate: python3 scripts/update_readme_config.py build/mop); e.g.:"
  echo "$missing" | sed 's/^/    /'
  failures=$((failures + 1))
fi

if [ "$failures" != 0 ]; then
  echo "$failures CLI check(s) failed"
  exit 1
fi
echo "all CLI checks passed"
