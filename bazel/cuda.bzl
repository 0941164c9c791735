"""CUDA under Bazel: `--config=cuda` (.bazelrc) builds against the host's CUDA
toolkit and a CUDA LibTorch, and compiles the fused kernels' .cu files with
nvcc. Without it, @libtorch is Debian's CPU LibTorch and no .cu is compiled.

--config=cuda sets --repo_env=TRIDENT_CUDA=1; these variables point at the
pieces (each has a default):
  CUDA_HOME          the CUDA toolkit (/usr/local/cuda): bin/nvcc, lib64/libcudart.so
  TRIDENT_LIBTORCH   a CUDA LibTorch (include/, lib/libtorch_cuda.so); default:
                     the torch package that python3 imports
  TRIDENT_CUDA_ARCHS the GPU architectures nvcc compiles for ("80,90")
A missing piece fails the build at once with one line naming it.
"""

_ENVIRON = ["TRIDENT_CUDA", "CUDA_HOME", "TRIDENT_LIBTORCH", "TRIDENT_CUDA_ARCHS"]

def _cuda_enabled(ctx):
    return ctx.os.environ.get("TRIDENT_CUDA", "") == "1"

def _python(ctx, code):
    result = ctx.execute(["python3", "-c", code])
    return result.stdout.strip() if result.return_code == 0 else ""

def _cuda_home(ctx):
    home = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not ctx.path(home + "/bin/nvcc").exists:
        fail("--config=cuda: no nvcc at %s/bin/nvcc; set CUDA_HOME to the CUDA toolkit " % home +
             "(bazel build --config=cuda --repo_env=CUDA_HOME=/path/to/cuda ...)")
    return home

def _cuda_libtorch(ctx):
    torch = ctx.os.environ.get("TRIDENT_LIBTORCH", "")
    if not torch:
        torch = _python(ctx, "import os, torch; print(os.path.dirname(torch.__file__))")
    if not torch:
        fail("--config=cuda: no CUDA LibTorch: TRIDENT_LIBTORCH is unset and python3 imports no torch; set it " +
             "(--repo_env=TRIDENT_LIBTORCH=/path/to/libtorch) or install PyTorch with CUDA for python3")
    if not ctx.path(torch + "/lib/libtorch_cuda.so").exists:
        fail("--config=cuda: the LibTorch at %s has no lib/libtorch_cuda.so (a CPU build?); " % torch +
             "set TRIDENT_LIBTORCH to a CUDA LibTorch (--repo_env=TRIDENT_LIBTORCH=/path/to/libtorch)")
    abi = _python(ctx, "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
    if abi == "0":
        fail("--config=cuda: the LibTorch at %s uses the pre-C++11 ABI, Debian's libraries the C++11 one; " % torch +
             "use a cxx11-abi LibTorch")
    return torch

def _nccl_include(ctx, cuda_home):
    # c10d's NCCL process group includes nccl.h: from the toolkit, or the
    # nvidia-nccl wheel beside PyTorch.
    for directory in [cuda_home + "/include", "/usr/include"]:
        if ctx.path(directory + "/nccl.h").exists:
            return directory
    wheel = _python(ctx, "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])")
    if wheel and ctx.path(wheel + "/include/nccl.h").exists:
        return wheel + "/include"
    fail("--config=cuda: no nccl.h under %s/include, /usr/include or the nvidia-nccl wheel; " % cuda_home +
         "install NCCL's headers")

def _libtorch_impl(ctx):
    if not _cuda_enabled(ctx):
        # Debian's CPU LibTorch, as new_local_repository would lay /usr out.
        for child in ctx.path("/usr").readdir():
            ctx.symlink(child, child.basename)
        ctx.symlink(ctx.attr.cpu_build_file, "BUILD.bazel")
        return
    cuda_home = _cuda_home(ctx)
    torch = _cuda_libtorch(ctx)
    nccl = _nccl_include(ctx, cuda_home)

    # PyTorch's include folder carries an old protobuf's headers: everything
    # else of it, so that Debian's protobuf is the one compiled against.
    for child in ctx.path(torch + "/include").readdir():
        if child.basename != "google":
            ctx.symlink(child, "include/" + child.basename)
    ctx.symlink(nccl, "nccl_include")
    ctx.file("BUILD.bazel", """# {torch} with CUDA ({cuda}), by //bazel:cuda.bzl.
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "libtorch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh", "nccl_include/*.h"]),
    defines = ["USE_C10D_GLOO", "USE_C10D_NCCL"],
    includes = ["include", "include/torch/csrc/api/include", "nccl_include"],
    linkopts = [
        "-L{torch}/lib",
        "-Wl,-rpath,{torch}/lib",
        "-Wl,--no-as-needed",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_cuda",
        "-lc10",
        "-lc10_cuda",
        "-Wl,--as-needed",
        "-L{cuda}/lib64",
        "-Wl,-rpath,{cuda}/lib64",
        "-lcudart",
        "-lpthread",
    ],
)
""".format(torch = torch, cuda = cuda_home))

trident_libtorch = repository_rule(
    implementation = _libtorch_impl,
    attrs = {"cpu_build_file": attr.label(mandatory = True)},
    environ = _ENVIRON,
    local = True,
)

def _cuda_config_impl(ctx):
    enabled = _cuda_enabled(ctx)
    home = _cuda_home(ctx) if enabled else ""
    archs = ctx.os.environ.get("TRIDENT_CUDA_ARCHS", "80,90").split(",")
    ctx.file("BUILD.bazel", "")
    ctx.file("defs.bzl", "\n".join([
        "# Written by //bazel:cuda.bzl (--config=cuda sets TRIDENT_CUDA=1).",
        "CUDA_ENABLED = %s" % enabled,
        "CUDA_HOME = %r" % home,
        "CUDA_ARCHS = %r" % [a.strip() for a in archs if a.strip()],
        "",
    ]))

# @trident_cuda//:defs.bzl: whether this build has CUDA, and where nvcc is.
trident_cuda_config = repository_rule(
    implementation = _cuda_config_impl,
    environ = _ENVIRON,
    local = True,
)
