// Text generation from a language model whose last layer returns next-token
// logits, across every layout: tensor-parallel vocabulary slices are
// gathered, pipeline stages pass activations on, and the last stage's token is
// broadcast so every rank keeps the same context.
#include <limits>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "trainer/internal/trainer_impl.h"

namespace trident {

absl::StatusOr<std::string> Trainer::Sample(const std::string& prompt, int64_t tokens) {
  Impl& t = *impl_;
  ParallelModel& model = *t.model;
  if (!model.source().returns_logits) {
    return absl::FailedPreconditionError("sampling needs a model whose outputs are next-token logits");
  }
  std::unique_ptr<Tokenizer> bytes = t.tokenizer ? nullptr : MakeByteTokenizer();
  const Tokenizer& tokenizer = t.tokenizer ? *t.tokenizer : *bytes;
  const int64_t vocab = model.source().vocab_size;
  std::vector<int64_t> ids;
  for (uint16_t id : tokenizer.Encode(prompt)) ids.push_back(id % vocab);
  if (ids.empty()) ids.push_back(0);
  const size_t prompt_length = ids.size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(t.config.plan().seed());
  const ProcessGroup* tp = model.tensor_parallel_group();
  const ProcessGroup* pp = model.pipeline_group();
  const int64_t align =
      model.plan().tensor_parallel().sequence_parallel() ? model.plan().tp() : 1;  // sequence shards must divide
  const int64_t block = model.source().sequence_length;
  // With a key/value cache the context is read once and each new token is
  // one position (padded to the sequence shards); once the text outgrows the
  // context every token re-reads the last `block` tokens, as without it.
  LayerSequence& layers = model.layers();
  const bool cached = t.config.generation().kv_cache() && layers.SupportsDecoding();
  int64_t cached_positions = 0;
  model.SetTraining(false);
  absl::Status sampled = CatchExceptions("sampling", [&] {
    for (int64_t i = 0; i < tokens; ++i) {
      const bool incremental = cached && i > 0 && cached_positions + align <= block;
      std::vector<int64_t> input;
      if (incremental) {
        input = {ids.back()};
      } else {
        const int64_t context = std::min<int64_t>(ids.size(), block / align * align);
        input.assign(ids.end() - context, ids.end());
        if (cached) layers.StartDecoding();
      }
      const int64_t valid = static_cast<int64_t>(input.size());
      // Padding after the input leaves its logits unchanged (causal attention).
      input.resize((valid + align - 1) / align * align, 0);
      at::Tensor next = at::zeros({1}, at::kLong);
      auto outputs = model.Forward({at::tensor(input, at::kLong).unsqueeze(0)});
      TORCH_CHECK(outputs.ok(), std::string(outputs.status().message()));
      if (cached) {
        cached_positions = (incremental ? cached_positions : 0) + valid;
        layers.KeepPositions(cached_positions);  // the padding's keys and values go
      }
      if (model.stage() == model.stages() - 1) {
        at::Tensor logits = outputs->at(0);
        const bool vocabulary_slices = tp != nullptr && model.plan().tensor_parallel().parallel_vocab();
        if (tp != nullptr && !vocabulary_slices && model.plan().tensor_parallel().sequence_parallel()) {
          // The whole vocabulary for this rank's sequence shard -> every position.
          auto gathered = tp->AllGather(logits.cpu().contiguous(), 1);
          TORCH_CHECK(gathered.ok(), std::string(gathered.status().message()));
          logits = *gathered;
        }
        logits = logits.select(1, valid - 1).squeeze(0).cpu();  // one position leaves the device
        if (vocabulary_slices) {                                // this rank's vocabulary slice -> all of it
          auto gathered = tp->AllGather(logits.contiguous(), 0);
          TORCH_CHECK(gathered.ok(), std::string(gathered.status().message()));
          logits = *gathered;
        }
        logits = logits / t.config.generation().temperature();
        if (t.config.generation().top_k() > 0 && t.config.generation().top_k() < logits.size(0)) {
          const double threshold = std::get<0>(logits.topk(t.config.generation().top_k()))[-1].item<double>();
          logits.masked_fill_(logits < threshold, -std::numeric_limits<float>::infinity());
        }
        next = at::multinomial(at::softmax(logits.to(at::kFloat), -1), 1, false, generator);
      }
      // Within each pipeline from its last stage; data-parallel replicas and
      // tensor-parallel ranks compute the same token.
      absl::Status shared =
          pp != nullptr ? pp->Broadcast(next, model.stages() - 1) : model.topology().world().Broadcast(next, 0);
      TORCH_CHECK(shared.ok(), std::string(shared.message()));
      ids.push_back(next.item<int64_t>());
    }
  });
  if (cached) layers.StopDecoding();
  model.SetTraining(true);
  TRIDENT_RETURN_IF_ERROR(sampled);
  if (model.topology().rank() != 0) return std::string();
  return tokenizer.Decode(std::vector<int64_t>(ids.begin() + prompt_length, ids.end()));
}

}  // namespace trident
