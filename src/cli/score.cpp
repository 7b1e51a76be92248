// `mop score` (see score.h). Weights go straight from the checkpoint's fp32 tensors into the
// compute weights (bf16 rounding on the GPU, as the trainer's master → weight cast), without
// optimizer state, so scoring needs only the weights, their gradient buffer and the activations.
#include "cli/score.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "ckpt/file_io.h"
#include "cli/forward_memory.h"
#include "cli/hf_checkpoint_reader.h"
#include "cli/text_codec.h"
#include "core/error.h"
#include "core/small_file.h"
#include "model/transformer.h"
#include "train/checkpointing.h"
#include "train/trainer.h"

namespace mop {

namespace {

// Calls f(line number from 1, the line without its '\n') for every line of `bytes`.
template <typename F>
void for_each_line(const std::string& bytes, F&& f) {
  size_t begin = 0, line_no = 0;
  while (begin < bytes.size()) {
    size_t end = bytes.find('\n', begin);
    if (end == std::string::npos) end = bytes.size();
    f(++line_no, std::string_view(bytes.data() + begin, end - begin));
    begin = end + 1;
  }
}

}  // namespace

std::vector<std::vector<int32_t>> read_token_file(const std::string& path, int64_t seq_len) {
  const std::string bytes = read_small_file(path, "--tokens", kTextFileCap);
  MOP_USER_CHECK(!bytes.empty(), "--tokens ", path, ": empty file");
  std::vector<std::vector<int32_t>> seqs;
  const bool text = std::all_of(bytes.begin(), bytes.end(), [](char c) {
    return (c >= '0' && c <= '9') || c == '-' || c == ' ' || c == '\t' || c == '\n' || c == '\r';
  });
  if (text) {
    for_each_line(bytes, [&](size_t line_no, std::string_view line) {
      std::vector<int32_t> seq;
      const char* p = line.data();
      const char* stop = line.data() + line.size();
      while (p < stop) {
        if (*p == ' ' || *p == '\t' || *p == '\r') {
          ++p;
          continue;
        }
        char* next = nullptr;
        long long v = std::strtoll(p, &next, 10);
        MOP_USER_CHECK(next != p && next <= stop && v >= INT32_MIN && v <= INT32_MAX, "--tokens ",
                       path, ": line ", line_no, ": '",
                       std::string(p, size_t(std::min<ptrdiff_t>(stop - p, 12))),
                       "' is not a token id");
        seq.push_back(int32_t(v));
        p = next;
      }
      if (!seq.empty()) seqs.push_back(std::move(seq));
    });
    MOP_USER_CHECK(!seqs.empty(), "--tokens ", path, ": no token ids");
    return seqs;
  }
  MOP_USER_CHECK(
      bytes.size() % 4 == 0, "--tokens ", path, ": ", bytes.size(),
      " bytes is not a whole number of int32 token ids (a text file may hold only digits, "
      "'-' and whitespace)");
  const int64_t n = int64_t(bytes.size() / 4);
  std::vector<int32_t> all(static_cast<size_t>(n));
  std::memcpy(all.data(), bytes.data(), bytes.size());
  const int64_t len = seq_len > 0 ? seq_len : n;
  MOP_USER_CHECK(n % len == 0, "--tokens ", path, ": ", n,
                 " tokens do not split into sequences of --seq-len ", len);
  for (int64_t s = 0; s < n; s += len) seqs.emplace_back(all.begin() + s, all.begin() + s + len);
  return seqs;
}

std::vector<std::vector<int32_t>> read_text_file(const std::string& path, const std::string& checkpoint) {
  // Read (or refused) before the checkpoint is opened: a wrong --text path is named first.
  const std::string bytes = read_small_file(path, "--text", kTextFileCap);
  const std::string dir = resolve_checkpoint_path(checkpoint, "--checkpoint");
  const TextCodec codec = TextCodec::for_checkpoint(dir, checkpoint_config(dir));
  std::vector<std::vector<int32_t>> seqs;
  for_each_line(bytes, [&](size_t line_no, std::string_view line) {
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) return;
    try {
      seqs.push_back(codec.encode(line));
    } catch (const UserError& e) {
      throw_user_error("--text ", path, ": line ", line_no, ": ", e.what());
    }
  });
  MOP_USER_CHECK(!seqs.empty(), "--text ", path, ": no text (every line is blank)");
  return seqs;
}

// The longest sequence mop score takes (16M tokens: the model's buffers index it with int; far
// beyond what one machine holds the activations of anyway).
constexpr int64_t kMaxScoreTokens = int64_t(1) << 24;

ScoreResult score_sequences(const std::string& checkpoint,
                            const std::vector<std::vector<int32_t>>& seqs,
                            const std::string& device, bool want_logits) {
  MOP_USER_CHECK(device == "cpu" || device == "cuda", "--device: '", device,
                 "' is not one of cpu, cuda");
  MOP_USER_CHECK(device != "cuda" || cuda_built(),
                 "--device cuda: this mop was built without CUDA (MOP_CUDA=OFF)");
  CheckpointTensors ckpt(resolve_checkpoint_path(checkpoint, "--checkpoint"));
  Config cfg = ckpt.config();
  cfg.train.device = device;
  cfg.train.precision = device == "cpu" ? "fp32" : "bf16";
  const RunPlacement placement = resolve_placement(cfg, device == "cuda" ? Device::CUDA : Device::CPU);
  std::unique_ptr<Ops> ops = make_ops(placement.device);
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  const bool gpu = placement.device == Device::CUDA;
  ParamStore params(layout, placement.compute, placement.grad,
                    gpu ? MemKind::Device : MemKind::Host);
  for (const HfView& v : layout.hf_views()) {
    const SafetensorsTensor& t = ckpt.at(v);
    Tensor w = params.weight(v.param);
    ops->copy(Tensor(static_cast<char*>(w.data) + size_t(v.offset) * dtype_size(w.dtype), w.dtype,
                     {t.numel()}, w.device),
              Tensor(const_cast<void*>(t.data), DType::F32, {t.numel()}));
  }

  ScoreResult r;
  r.vocab = cfg.model.vocab_size;
  int64_t max_len = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (size_t i = 0; i < seqs[s].size(); ++i)
      MOP_USER_CHECK(seqs[s][i] >= 0 && seqs[s][i] < r.vocab, "--tokens: token ", seqs[s][i],
                     " at position ", i, " of sequence ", s + 1,
                     " is outside the vocabulary (vocab_size ", r.vocab, ")");
    max_len = std::max<int64_t>(max_len, int64_t(seqs[s].size()));
    r.tokens += int64_t(seqs[s].size());
  }
  MOP_USER_CHECK(max_len > 0, "--tokens: no token ids");
  MOP_USER_CHECK(max_len <= kMaxScoreTokens, "--tokens/--text: a sequence of ", max_len,
                 " tokens; mop score takes sequences of at most ", kMaxScoreTokens);
  TransformerOptions topt;
  topt.plan.max_batch = 1;
  topt.plan.max_seq = int(max_len);
  topt.plan.lm_head_chunk = cfg.train.lm_head_chunk;
  {
    // The weights are in place already; the logits (fp32 on the host, and a sequence's on a GPU).
    size_t other = want_logits ? size_t(r.tokens) * size_t(r.vocab) * sizeof(float) : 0;
    if (gpu && want_logits) other += size_t(max_len) * size_t(r.vocab) * dtype_size(acc_dtype(placement.compute));
    check_forward_memory("score: the longest sequence", layout.dims, topt.plan, other, placement.device);
  }
  Transformer model(layout, params, *ops, topt);
  model.allocate();

  const DType acc = acc_dtype(placement.compute);
  const size_t L = size_t(max_len);
  Buffer batch_dev, logits_dev;
  if (gpu) {
    batch_dev = Buffer(MemKind::Device, 3 * L * sizeof(int32_t));
    if (want_logits) logits_dev = Buffer(MemKind::Device, L * size_t(r.vocab) * dtype_size(acc));
  }
  if (want_logits) r.logits.resize(size_t(r.tokens) * size_t(r.vocab));
  std::vector<int32_t> ids(L), targets(L), positions(L);
  std::iota(positions.begin(), positions.end(), 0);
  float* out = r.logits.data();
  for (const std::vector<int32_t>& seq : seqs) {
    const int64_t n = int64_t(seq.size());
    for (int64_t i = 0; i < n; ++i) {
      ids[size_t(i)] = seq[size_t(i)];
      targets[size_t(i)] = i + 1 < n ? seq[size_t(i + 1)] : -1;
    }
    Batch b{1, int(n), Tensor(ids.data(), DType::I32, {n}), Tensor(targets.data(), DType::I32, {n}),
            Tensor(positions.data(), DType::I32, {n})};
    if (gpu) {
      int32_t* dev = static_cast<int32_t*>(batch_dev.data());
      Tensor* parts[3] = {&b.ids, &b.targets, &b.positions};
      for (int k = 0; k < 3; ++k) {
        Tensor d(dev + size_t(k) * L, DType::I32, {n}, Device::CUDA);
        ops->copy(d, *parts[k]);
        *parts[k] = d;
      }
    }
    model.forward(b, 1.0f);
    r.ce_sum += model.take_losses().ce_sum;
    r.predicted += n - 1;
    if (!want_logits) continue;
    // acc dtype is F32 in both runs (fp32 on the CPU, bf16 compute with fp32 logits on the GPU).
    MOP_CHECK(acc == DType::F32, "score logits are fp32");
    Tensor all = gpu ? Tensor(logits_dev.data(), acc, {n, r.vocab}, Device::CUDA)
                     : Tensor(out, acc, {n, r.vocab});
    for (int64_t i = 0; i < n; ++i) model.logits(all.at(i), int(i));
    if (gpu) ops->copy(Tensor(out, acc, {n, r.vocab}), all);
    out += size_t(n) * size_t(r.vocab);
  }
  ops->synchronize();
  return r;
}

int cmd_score(const ScoreArgs& args) {
  MOP_USER_CHECK(args.tokens.empty() != args.text.empty(), "mop score needs one of --tokens (ids) and --text (text)");
  std::vector<std::vector<int32_t>> seqs = args.text.empty() ? read_token_file(args.tokens, args.seq_len)
                                                             : read_text_file(args.text, args.checkpoint);
  ScoreResult r = score_sequences(args.checkpoint, seqs, args.device, !args.out.empty());
  if (!args.out.empty())
    write_file_atomic(args.out, std::string_view(reinterpret_cast<const char*>(r.logits.data()),
                                                 r.logits.size() * sizeof(float)));
  std::printf("score: %zu sequence(s), %lld tokens, %lld predicted, on %s (%s)\n", seqs.size(),
              (long long)r.tokens, (long long)r.predicted, args.device.c_str(),
              args.device == "cpu" ? "fp32" : "bf16");
  std::printf("mean cross-entropy %.10g nats (perplexity %.6g)\n", r.mean_ce(),
              std::exp(r.mean_ce()));
  if (!args.out.empty())
    std::printf("logits: %s (float32, [%lld, %lld] row-major)\n", args.out.c_str(),
                (long long)r.tokens, (long long)r.vocab);
  return 0;
}

}  // namespace mop
