#include <numeric>
#include <random>

#include "base/logging.h"
#include "data/data.h"

namespace trident {

BatchSampler::BatchSampler(int64_t num_samples, int64_t global_batch_size, uint64_t seed, bool shuffle)
    : num_samples_(num_samples), global_batch_size_(global_batch_size), seed_(seed), shuffle_(shuffle) {
  CHECK_GT(num_samples, 0);
  CHECK_GT(global_batch_size, 0);
}

int64_t BatchSampler::SampleIndex(int64_t step, int64_t j) const {
  const int64_t position = step * global_batch_size_ + j;
  const int64_t index = position % num_samples_;
  if (!shuffle_) return index;
  const int64_t epoch = position / num_samples_;
  if (epoch != cached_epoch_) {
    // NOTE: a fixed generator (not std::shuffle, whose algorithm is unspecified)
    // keeps the order identical across standard libraries and layouts.
    permutation_.resize(num_samples_);
    std::iota(permutation_.begin(), permutation_.end(), 0);
    std::mt19937_64 generator(seed_ * 1000003 + static_cast<uint64_t>(epoch));
    for (int64_t i = num_samples_ - 1; i > 0; --i) {
      const int64_t k = static_cast<int64_t>(generator() % static_cast<uint64_t>(i + 1));
      std::swap(permutation_[i], permutation_[k]);
    }
    cached_epoch_ = epoch;
  }
  return permutation_[index];
}

std::vector<int64_t> BatchSampler::MicroBatch(int64_t step, int dp, int dp_rank, int64_t micro_batch_size,
                                              int64_t micro) const {
  CHECK_EQ(global_batch_size_ % dp, 0);
  const int64_t first = dp_rank * (global_batch_size_ / dp) + micro * micro_batch_size;
  CHECK_LE(first + micro_batch_size, (dp_rank + 1) * (global_batch_size_ / dp));
  std::vector<int64_t> samples;
  for (int64_t j = first; j < first + micro_batch_size; ++j) {
    samples.push_back(SampleIndex(step, j));
  }
  return samples;
}

int64_t BatchSampler::Epoch(int64_t step) const { return step * global_batch_size_ / num_samples_; }

}  // namespace trident
