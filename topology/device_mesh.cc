#include "topology/device_mesh.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"

namespace trident {

absl::StatusOr<DeviceMesh> DeviceMesh::Create(std::vector<MeshAxis> axes, int world_size, std::vector<int> rank_order) {
  if (world_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("world size must be positive, got ", world_size));
  }
  std::set<std::string> names;
  int infer_position = -1;
  int known_product = 1;
  for (int i = 0; i < static_cast<int>(axes.size()); ++i) {
    const MeshAxis& axis = axes[i];
    if (axis.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("mesh axis ", i, " has no name"));
    }
    if (!names.insert(axis.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh axis '", axis.name, "' appears twice; give each axis one size"));
    }
    if (axis.size == kInferSize) {
      if (infer_position >= 0) {
        return absl::InvalidArgumentError(absl::StrCat("mesh axes '", axes[infer_position].name, "' and '", axis.name,
                                                       "' both ask to be inferred; give all but one of them a size"));
      }
      infer_position = i;
    } else if (axis.size <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh axis '", axis.name, "' has size ", axis.size, "; sizes must be positive"));
    } else {
      known_product *= axis.size;
    }
  }
  auto describe = [&axes] {
    std::vector<std::string> parts;
    for (const MeshAxis& a : axes) {
      parts.push_back(absl::StrCat(a.name, "=", a.size == kInferSize ? "?" : absl::StrCat(a.size)));
    }
    return absl::StrJoin(parts, " x ");
  };
  if (infer_position >= 0) {
    if (world_size % known_product != 0) {
      return absl::InvalidArgumentError(absl::StrCat("cannot infer mesh axis '", axes[infer_position].name,
                                                     "': world size ", world_size, " is not divisible by the product ",
                                                     known_product, " of the other axes (", describe(),
                                                     "); change the axis sizes or the number of ranks"));
    }
    axes[infer_position].size = world_size / known_product;
  } else if (known_product != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh ", describe(), " has ", known_product, " ranks but the world size is ", world_size,
                     "; make the axis sizes multiply to the number of ranks or leave one to be inferred"));
  }
  if (!rank_order.empty()) {
    std::vector<int> sorted = rank_order;
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < static_cast<int>(sorted.size()); ++i) {
      if (sorted[i] != i || static_cast<int>(sorted.size()) != world_size) {
        return absl::InvalidArgumentError(absl::StrCat("rank order ", absl::StrJoin(rank_order, ","),
                                                       " is not a permutation of the ranks 0 to ", world_size - 1,
                                                       "; list every rank once, in the order of the mesh positions"));
      }
    }
    bool identity = true;
    for (int i = 0; i < world_size; ++i) identity &= rank_order[i] == i;
    if (identity) rank_order.clear();
  }
  return DeviceMesh(std::move(axes), world_size, std::move(rank_order));
}

DeviceMesh::DeviceMesh(std::vector<MeshAxis> axes, int world_size, std::vector<int> rank_order)
    : axes_(std::move(axes)), rank_order_(std::move(rank_order)), world_size_(world_size) {
  int stride = 1;
  for (const MeshAxis& axis : axes_) {
    strides_.push_back(stride);
    stride *= axis.size;
  }
  if (!rank_order_.empty()) {
    position_of_.assign(world_size_, 0);
    for (int i = 0; i < world_size_; ++i) position_of_[rank_order_[i]] = i;
  }
}

int DeviceMesh::AxisPosition(absl::string_view axis) const {
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) {
    if (axes_[i].name == axis) return i;
  }
  return -1;
}

bool DeviceMesh::HasAxis(absl::string_view axis) const { return AxisPosition(axis) >= 0; }

int DeviceMesh::AxisSize(absl::string_view axis) const {
  int position = AxisPosition(axis);
  return position < 0 ? 1 : axes_[position].size;
}

std::vector<int> DeviceMesh::Coordinates(int rank) const {
  CHECK(rank >= 0 && rank < world_size_) << "rank " << rank << " outside mesh " << ToString();
  const int position = position_of_.empty() ? rank : position_of_[rank];
  std::vector<int> coordinates;
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) {
    coordinates.push_back((position / strides_[i]) % axes_[i].size);
  }
  return coordinates;
}

int DeviceMesh::RankAt(const std::vector<int>& coordinates) const {
  CHECK_EQ(coordinates.size(), axes_.size());
  int position = 0;
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) {
    CHECK(coordinates[i] >= 0 && coordinates[i] < axes_[i].size);
    position += coordinates[i] * strides_[i];
  }
  return rank_order_.empty() ? position : rank_order_[position];
}

int DeviceMesh::AxisIndex(absl::string_view axis, int rank) const {
  int position = AxisPosition(axis);
  return position < 0 ? 0 : Coordinates(rank)[position];
}

std::vector<int> DeviceMesh::GroupRanks(const std::vector<std::string>& group_axes, int rank) const {
  std::vector<int> base = Coordinates(rank);
  std::vector<int> positions;
  for (const std::string& axis : group_axes) {
    int position = AxisPosition(axis);
    if (position >= 0) {
      base[position] = 0;
      positions.push_back(position);
    }
  }
  int origin = 0;
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) origin += base[i] * strides_[i];
  std::vector<int> members = {origin};  // mesh positions
  for (int position : positions) {
    std::vector<int> expanded;
    for (int p : members) {
      for (int k = 0; k < axes_[position].size; ++k) expanded.push_back(p + k * strides_[position]);
    }
    members = std::move(expanded);
  }
  std::sort(members.begin(), members.end());
  if (!rank_order_.empty()) {
    for (int& member : members) member = rank_order_[member];
  }
  return members;
}

std::vector<int> DeviceMesh::GroupRanks(absl::string_view axis, int rank) const {
  return GroupRanks(std::vector<std::string>{std::string(axis)}, rank);
}

std::vector<std::vector<int>> DeviceMesh::AllGroups(const std::vector<std::string>& group_axes) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> covered(world_size_, false);
  for (int position = 0; position < world_size_; ++position) {
    const int rank = rank_order_.empty() ? position : rank_order_[position];
    if (covered[rank]) continue;
    groups.push_back(GroupRanks(group_axes, rank));
    for (int member : groups.back()) covered[member] = true;
  }
  return groups;
}

std::string DeviceMesh::ToString() const {
  std::vector<std::string> parts;
  for (const MeshAxis& axis : axes_) parts.push_back(absl::StrCat(axis.name, "=", axis.size));
  return absl::StrCat(parts.empty() ? "(no axes)" : absl::StrJoin(parts, " x "), " (", world_size_, " ranks",
                      rank_order_.empty() ? "" : absl::StrCat(", rank order ", absl::StrJoin(rank_order_, ",")), ")");
}

}  // namespace trident
