// DeviceMesh: the ranks of a job laid out on named axes, like the reference
// design's `parallel_mode`. The first axis varies fastest.
//
//   // 16 ranks: tensor groups [0..3] [4..7] ..., pipeline groups [0,4] [1,5] ...,
//   // data groups [0,8] [1,9] ...
//   absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(
//       {{"tensor", 4}, {"pipeline", 2}, {"data", DeviceMesh::kInferSize}}, 16);
//   std::vector<int> dp = mesh->GroupRanks("data", /*rank=*/3);  // {3, 11}
//
// A rank order (the reference's second item of parallel_mode) places rank
// rank_order[i] at mesh position i; empty is the identity.
#ifndef TRIDENT_TOPOLOGY_DEVICE_MESH_H_
#define TRIDENT_TOPOLOGY_DEVICE_MESH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace trident {

// One named axis of a DeviceMesh.
struct MeshAxis {
  std::string name;  // "tensor", "pipeline", "data", later "sequence", "expert", ...
  int size = 1;      // number of ranks along the axis, or DeviceMesh::kInferSize
};

class DeviceMesh {
 public:
  // An axis size that Create infers as world_size / (product of the others).
  static constexpr int kInferSize = -1;

  // Lays `world_size` ranks out on `axes` (first axis fastest). Errors when the
  // sizes do not multiply to `world_size`, a name repeats or is empty, or more
  // than one axis asks to be inferred, or `rank_order` (when not empty) is not
  // a permutation of 0 .. world_size - 1.
  static absl::StatusOr<DeviceMesh> Create(std::vector<MeshAxis> axes, int world_size,
                                           std::vector<int> rank_order = {});

  int world_size() const { return world_size_; }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  // The rank at each mesh position (empty: the identity).
  const std::vector<int>& rank_order() const { return rank_order_; }

  // Whether the mesh has an axis called `axis`.
  bool HasAxis(absl::string_view axis) const;
  // Size of `axis`; 1 for an axis the mesh does not have (a dimension that is not split).
  int AxisSize(absl::string_view axis) const;

  // Coordinates of `rank`, one per axis, in axis order.
  std::vector<int> Coordinates(int rank) const;
  // Rank at `coordinates` (one per axis).
  int RankAt(const std::vector<int>& coordinates) const;
  // Coordinate of `rank` along `axis` (0 for an axis the mesh does not have).
  int AxisIndex(absl::string_view axis, int rank) const;

  // Ranks that share every coordinate with `rank` except those along `group_axes`,
  // in mesh order (first axis fastest; increasing for the identity rank
  // order): the process group of `rank` spanning `group_axes`, whose group
  // rank i is the i-th of them.
  // Unknown axis names are ignored (they have size 1).
  std::vector<int> GroupRanks(const std::vector<std::string>& group_axes, int rank) const;
  std::vector<int> GroupRanks(absl::string_view axis, int rank) const;

  // Every group spanning `group_axes`, ordered by their first member's mesh position.
  std::vector<std::vector<int>> AllGroups(const std::vector<std::string>& group_axes) const;

  // "tensor=4 x pipeline=2 x data=2 (16 ranks)", then the rank order when it
  // is not the identity.
  std::string ToString() const;

 private:
  DeviceMesh(std::vector<MeshAxis> axes, int world_size, std::vector<int> rank_order);
  int AxisPosition(absl::string_view axis) const;  // -1 when absent

  std::vector<MeshAxis> axes_;
  std::vector<int> rank_order_;   // position -> rank (empty: identity)
  std::vector<int> position_of_;  // rank -> position (empty: identity)
  std::vector<int> strides_;
  int world_size_;
};

}  // namespace trident

#endif  // TRIDENT_TOPOLOGY_DEVICE_MESH_H_
