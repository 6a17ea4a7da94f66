/*
 * noop_op.cc: a benchmark-only MXNet external library (lib_api) with one op, bench_noop:
 * data -> out of the same shape and dtype, whose forward (and backward) does nothing (out is left unwritten). It
 * measures the per-call floor that MXNet's lib_api dispatch itself costs (attribute marshalling,
 * MXTensor construction, the C ABI hop) against a built-in op. Built and loaded by
 * benchmarks/bench_overhead.py; not part of gn_mx.
 */
#include <string>
#include <unordered_map>
#include <vector>

#include "lib_api.h"

using namespace mxnet::ext;

MXReturnValue noop_parse(const std::unordered_map<std::string, std::string>&, int* num_in,
                         int* num_out) {
  *num_in = 1;
  *num_out = 1;
  return MX_SUCCESS;
}

MXReturnValue noop_type(const std::unordered_map<std::string, std::string>&, std::vector<int>* in,
                        std::vector<int>* out) {
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}

MXReturnValue noop_shape(const std::unordered_map<std::string, std::string>&,
                         std::vector<std::vector<unsigned int>>* in,
                         std::vector<std::vector<unsigned int>>* out) {
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}

MXReturnValue noop_fwd(const std::unordered_map<std::string, std::string>&, std::vector<MXTensor>*,
                       std::vector<MXTensor>*, const OpResource&) {
  return MX_SUCCESS;
}

// Backward (also empty) so that hybridized graphs can contain the op.
MXReturnValue noop_bwd(const std::unordered_map<std::string, std::string>&, std::vector<MXTensor>*,
                       std::vector<MXTensor>*, const OpResource&) {
  return MX_SUCCESS;
}

REGISTER_OP(bench_noop)
    .setParseAttrs(noop_parse)
    .setInferType(noop_type)
    .setInferShape(noop_shape)
    .setForward(noop_fwd, "cpu")
    .setBackward(noop_bwd, "cpu");

MXReturnValue initialize(int) { return MX_SUCCESS; }
