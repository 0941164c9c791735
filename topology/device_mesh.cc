#include "topology/device_mesh.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"

namespace trident {

absl::StatusOr<DeviceMesh> DeviceMesh::Create(std::vector<MeshAxis> axes, int world_size) {
  if (world_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be positive, got ", world_size));
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
        return absl::InvalidArgumentError(absl::StrCat(
            "mesh axes '", axes[infer_position].name, "' and '", axis.name,
            "' both ask to be inferred; give all but one of them a size"));
      }
      infer_position = i;
    } else if (axis.size <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh axis '", axis.name, "' has size ", axis.size, "; sizes must be positive"));
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
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot infer mesh axis '", axes[infer_position].name, "': world size ", world_size,
          " is not divisible by the product ", known_product, " of the other axes (",
          describe(), "); change the axis sizes or the number of ranks"));
    }
    axes[infer_position].size = world_size / known_product;
  } else if (known_product != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mesh ", describe(), " has ", known_product, " ranks but the world size is ", world_size,
        "; make the axis sizes multiply to the number of ranks or leave one to be inferred"));
  }
  return DeviceMesh(std::move(axes), world_size);
}

DeviceMesh::DeviceMesh(std::vector<MeshAxis> axes, int world_size)
    : axes_(std::move(axes)), world_size_(world_size) {
  int stride = 1;
  for (const MeshAxis& axis : axes_) {
    strides_.push_back(stride);
    stride *= axis.size;
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
  std::vector<int> coordinates;
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) {
    coordinates.push_back((rank / strides_[i]) % axes_[i].size);
  }
  return coordinates;
}

int DeviceMesh::RankAt(const std::vector<int>& coordinates) const {
  CHECK_EQ(coordinates.size(), axes_.size());
  int rank = 0;
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) {
    CHECK(coordinates[i] >= 0 && coordinates[i] < axes_[i].size);
    rank += coordinates[i] * strides_[i];
  }
  return rank;
}

int DeviceMesh::AxisIndex(absl::string_view axis, int rank) const {
  int position = AxisPosition(axis);
  return position < 0 ? 0 : Coordinates(rank)[position];
}

std::vector<int> DeviceMesh::GroupRanks(const std::vector<std::string>& group_axes,
                                        int rank) const {
  std::vector<int> base = Coordinates(rank);
  std::vector<int> positions;
  for (const std::string& axis : group_axes) {
    int position = AxisPosition(axis);
    if (position >= 0) {
      base[position] = 0;
      positions.push_back(position);
    }
  }
  std::vector<int> ranks = {RankAt(base)};
  for (int position : positions) {
    std::vector<int> expanded;
    for (int r : ranks) {
      for (int k = 0; k < axes_[position].size; ++k) expanded.push_back(r + k * strides_[position]);
    }
    ranks = std::move(expanded);
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

std::vector<int> DeviceMesh::GroupRanks(absl::string_view axis, int rank) const {
  return GroupRanks(std::vector<std::string>{std::string(axis)}, rank);
}

std::vector<std::vector<int>> DeviceMesh::AllGroups(
    const std::vector<std::string>& group_axes) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> covered(world_size_, false);
  for (int rank = 0; rank < world_size_; ++rank) {
    if (covered[rank]) continue;
    groups.push_back(GroupRanks(group_axes, rank));
    for (int member : groups.back()) covered[member] = true;
  }
  return groups;
}

std::string DeviceMesh::ToString() const {
  std::vector<std::string> parts;
  for (const MeshAxis& axis : axes_) parts.push_back(absl::StrCat(axis.name, "=", axis.size));
  return absl::StrCat(parts.empty() ? "(no axes)" : absl::StrJoin(parts, " x "), " (",
                      world_size_, " ranks)");
}

}  // namespace trident
