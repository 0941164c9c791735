"""CUDA sources in a Bazel package (see //bazel:cuda.bzl for --config=cuda)."""

load("@trident_cuda//:defs.bzl", _CUDA_ARCHS = "CUDA_ARCHS", _CUDA_ENABLED = "CUDA_ENABLED", _CUDA_HOME = "CUDA_HOME")

# Whether this build compiles CUDA (--config=cuda): BUILD files add their
# CUDA host sources (*_cuda.cc) and the trident_cuda_objects target with it.
CUDA_ENABLED = _CUDA_ENABLED

def trident_cuda_objects(name, srcs, hdrs = [], **kwargs):
    """A cc_library of `srcs` (.cu files of this package) compiled by nvcc
    against CUDA's shared runtime (the one LibTorch loads), for the
    architectures of TRIDENT_CUDA_ARCHS; `hdrs` are the headers they include
    (by paths from Trident's root). Without --config=cuda: an empty library.
    """
    if not CUDA_ENABLED:
        native.cc_library(name = name, **kwargs)
        return
    repository = native.repository_name()
    root = "." if repository == "@" else "external/" + repository[1:]
    gencode = " ".join(["-gencode=arch=compute_%s,code=sm_%s" % (a, a) for a in _CUDA_ARCHS])
    objects = []
    for src in srcs:
        stem = src[:-len(".cu")]
        objects.append(stem + ".pic.o")
        native.genrule(
            name = name + "_" + stem.replace("/", "_"),
            srcs = [src] + hdrs,
            outs = [stem + ".pic.o"],
            cmd = ("%s/bin/nvcc -c -std=c++17 -O3 -Xcompiler -fPIC %s -I%s -o $@ $(location %s)" %
                   (_CUDA_HOME, gencode, root, src)),
        )
    native.cc_library(
        name = name,
        srcs = objects,
        linkopts = ["-L%s/lib64" % _CUDA_HOME, "-lcudart"],
        alwayslink = 1,
        **kwargs
    )
