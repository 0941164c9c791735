"""The external repositories Trident needs, for its own WORKSPACE and for any
workspace that builds on it:

    local_repository(name = "trident", path = "/path/to/trident")  # or http_archive
    load("@trident//bazel:deps.bzl", "trident_dependencies")
    trident_dependencies()

Everything is offline: the system libraries that tools/setup.sh installs
(Debian packages), wrapped as Bazel targets, and local stand-ins for the rule
repositories Bazel 4.2.3 would otherwise download.

With --config=cuda (.bazelrc), @libtorch is the host's CUDA LibTorch and
@trident_cuda says where nvcc is (bazel/cuda.bzl).
"""

load("//bazel:cuda.bzl", "trident_cuda_config", "trident_libtorch")

def _trident_tree_impl(ctx):
    # A directory of Trident's tree as a repository of its own (symlinked).
    root = ctx.path(Label("//:WORKSPACE")).dirname
    source = root
    for part in ctx.attr.directory.split("/"):
        source = source.get_child(part)
    for child in source.readdir():
        ctx.symlink(child, child.basename)

_trident_tree = repository_rule(
    implementation = _trident_tree_impl,
    attrs = {"directory": attr.string(mandatory = True)},
    local = True,
)

def _system_library(name, path, build_file):
    if not native.existing_rule(name):
        native.new_local_repository(name = name, path = path, build_file = build_file)

def trident_dependencies():
    """Declares Trident's repositories that the calling workspace does not already have."""
    for shim in ["rules_cc", "rules_java", "remote_coverage_tools"]:
        if not native.existing_rule(shim):
            _trident_tree(name = shim, directory = "third_party/" + shim)
    if not native.existing_rule("platforms"):
        native.local_repository(name = "platforms", path = "/usr/share/bazel/platforms")
    if not native.existing_rule("libtorch"):
        trident_libtorch(name = "libtorch", cpu_build_file = Label("//third_party:libtorch.BUILD"))
    if not native.existing_rule("trident_cuda"):
        trident_cuda_config(name = "trident_cuda")
    for name in ["absl", "glog", "gflags", "protobuf", "gtest", "benchmark", "zlib"]:
        _system_library(name, "/usr", str(Label("//third_party:%s.BUILD" % name)))
