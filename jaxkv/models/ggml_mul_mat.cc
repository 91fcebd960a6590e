// jaxkv's XLA FFI custom call into ggml's CPU matrix product (jaxkv/models/ggml.py builds and
// registers it): out[M, N] = x[M, K] @ W[layer]^T for a weight held in one of ggml's block
// types (Q8_0, Q4_0, Q4_1: the GGUF file's own bytes), W[..., N, row_bytes]. ggml quantises the
// activations to its dot type (Q8_0 / Q8_1 blocks of 32) and multiplies block by block, as
// llama.cpp does; the weights are read where XLA holds them (the whole stack and a layer index,
// so that a layer scan copies nothing).
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One product at a time: XLA may run independent custom calls on two of its threads, and a
// ggml thread pool computes one graph at a time.
std::mutex mutex;
ggml_threadpool* pool = nullptr;
int pool_threads = 0;
std::vector<uint8_t> work;

ffi::Error MulMat(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> out, int64_t type, int64_t threads) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || layer.element_count() != 1 || threads < 1) {
    return ffi::Error::InvalidArgument("ggml_mul_mat: expected x [M, K], W [..., N, row_bytes], one layer index");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[wd.size() - 2], row_bytes = wd[wd.size() - 1];
  const int64_t layers = static_cast<int64_t>(w.element_count()) / (n * row_bytes);
  const ggml_type t = static_cast<ggml_type>(type);
  if (type < 0 || type >= GGML_TYPE_COUNT || k % ggml_blck_size(t) != 0 ||
      static_cast<int64_t>(ggml_row_size(t, k)) != row_bytes) {
    return ffi::Error::InvalidArgument("ggml_mul_mat: W's rows of " + std::to_string(row_bytes) +
                                       " bytes do not hold " + std::to_string(k) + " inputs of ggml type " +
                                       std::to_string(type));
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= layers) {
    return ffi::Error::InvalidArgument("ggml_mul_mat: layer " + std::to_string(index) + " of " +
                                       std::to_string(layers));
  }
  const uint8_t* rows = static_cast<const uint8_t*>(w.untyped_data()) + index * n * row_bytes;

  std::lock_guard<std::mutex> lock(mutex);
  if (pool == nullptr || pool_threads != threads) {
    if (pool != nullptr) ggml_threadpool_free(pool);
    ggml_cpu_init();
    ggml_threadpool_params params = ggml_threadpool_params_default(static_cast<int>(threads));
    pool = ggml_threadpool_new(&params);
    pool_threads = static_cast<int>(threads);
  }
  // Three tensor headers and a one-node graph: the data stays where XLA holds it.
  alignas(64) static uint8_t meta[16384];
  ggml_init_params init = {sizeof(meta), meta, /*no_alloc=*/true};
  ggml_context* ctx = ggml_init(init);
  ggml_tensor* a = ggml_new_tensor_2d(ctx, t, k, n);
  a->data = const_cast<uint8_t*>(rows);
  ggml_tensor* b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
  b->data = x.typed_data();
  ggml_tensor* c = ggml_mul_mat(ctx, a, b);  // [M, N] row-major: ggml's ne0 = N is the minor axis
  c->data = out->typed_data();
  ggml_cgraph* graph = ggml_new_graph_custom(ctx, 4, false);
  ggml_build_forward_expand(graph, c);
  ggml_cplan plan = ggml_graph_plan(graph, pool_threads, pool);
  if (work.size() < plan.work_size) work.resize(plan.work_size);
  plan.work_data = work.data();
  const ggml_status status = ggml_graph_compute(graph, &plan);
  ggml_free(ctx);
  if (status != GGML_STATUS_SUCCESS) {
    return ffi::Error::Internal("ggml_mul_mat: ggml_graph_compute returned " + std::to_string(status));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvGgmlMulMat, MulMat,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type")
                                  .Attr<int64_t>("threads"));
