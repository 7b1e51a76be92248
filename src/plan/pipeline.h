// Pipeline stages (the pp axis): how a model's segments are split into stages, the order in which a
// stage's rank runs its micro-batches' forward and backward passes (1F1B; interleaved, with
// several virtual stages per rank), the sends and receives between neighbouring stages that order
// implies, and a symbolic run of every rank's sequence that proves each send meets its receive in
// order and that no rank waits forever. Pure functions: the plan prices and the tests check them.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mop {

// Contiguous segments per stage: stage i holds segments [first[i], first[i + 1]).
struct StageSplit {
  std::vector<int> first;  // stages + 1 entries, first[0] = 0, the last = the segments
  int stages() const { return int(first.size()) - 1; }
  int stage_of(int segment) const;
};

// The split of `time.size()` segments into `stages` contiguous stages, each at least one segment,
// that makes the slowest stage (the sum of its segments' time) fastest among those that `fits`
// (stage index, first segment, end segment) accepts; nullopt when none does. Ties: the split
// whose earlier stages are shorter (the first stage holds the most micro-batches in flight).
std::optional<StageSplit> split_stages(
    const std::vector<double>& time, int stages,
    const std::function<bool(int stage, int first, int end)>& fits);

// With interleaving, rank r runs virtual stages r, r + ranks, r + 2·ranks, ...: its time is their
// sum. Moves segments between `split`'s virtual stages (one at a time, passed along the stages in
// between) while that lowers the busiest rank's time (then how many ranks are that busy, then the
// slowest virtual stage); each stage keeps at least one segment. Never slower than `split`; for
// equal segments the busiest rank holds ⌈segments / ranks⌉.
StageSplit balance_ranks(const std::vector<double>& time, StageSplit split, int ranks);

// One pass of a stage's rank: the forward or backward of micro-batch `micro_batch` through its
// virtual stage `chunk` (0 .. chunks − 1: the rank's chunk c is virtual stage c · ranks + rank).
struct PipePass {
  bool forward = true;
  int micro_batch = 0, chunk = 0;
  bool operator==(const PipePass&) const = default;
};

// The passes of pipeline rank `rank` of `ranks`, in order. 1F1B: the warm-up forwards the stages
// after it need, then one forward and one backward in turn, then the remaining backwards.
std::vector<PipePass> one_f_one_b(int rank, int ranks, int micro_batches);
// Interleaved 1F1B over `chunks` virtual stages per rank (micro-batches a multiple of ranks):
// forwards in groups of `ranks` micro-batches per chunk, chunk by chunk, backwards the same way
// from the last chunk; with chunks = 1 it is one_f_one_b.
std::vector<PipePass> interleaved(int rank, int ranks, int micro_batches, int chunks);

// A rank's pipeline program with its messages: passes, sends and receives to and from the
// neighbouring pipeline ranks. A message's tag names what it carries.
struct PipeOp {
  enum Kind { Pass, Send, Recv } kind = Pass;
  PipePass pass;  // Pass; for Send and Recv, the pass whose activation or gradient travels
  int peer = -1;  // Send, Recv: the other pipeline rank
  bool operator==(const PipeOp&) const = default;
};
std::string describe(const PipeOp& op);

// Each rank's passes with the messages they imply: before a forward, the activation from the
// previous virtual stage (unless it is the first); after it, the activation to the next (unless
// last); before a backward, the gradient from the next; after it, the gradient to the previous.
std::vector<std::vector<PipeOp>> pipeline_messages(const std::vector<std::vector<PipePass>>& passes,
                                                   int chunks);

// Runs every rank's ops symbolically: a pass completes at once, a send is queued on its (from, to)
// link, a receive waits for the link's oldest message and must be the one it expects. "" when every
// rank finishes and no message is left; else what went wrong (a rank waiting forever, a message
// out of order, a send never received).
std::string check_pipeline(const std::vector<std::vector<PipeOp>>& ranks);

}  // namespace mop
