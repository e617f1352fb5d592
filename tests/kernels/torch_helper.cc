// Runs the kernels on tensors written by torch_gradient_check.py, for the PyTorch cross-check.
// Usage: fcp_kernels_torch_helper DIR. DIR/spec.txt holds
//   nq nk hq hkv d causal|full fp32|bf16
//   numQSegments (numTokens sequenceId firstPosition)...
//   numKSegments (numTokens sequenceId firstPosition)...
// and DIR/{q,k,v,do}.bin the fp32 inputs (row major [tokens, heads, d]). Writes DIR/{o,lse,dq,
// dk,dv}.bin in fp32 after forward -> computeDelta -> backward, as the runtime would call them.
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"

namespace {

using namespace fcp::kernels;

std::vector<float> readFloats(const std::string& path, size_t count) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> out(count);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(count * sizeof(float)));
  if (!in) fcp::throwInvalidArgument("cannot read ", count, " floats from ", path);
  return out;
}

void writeFloats(const std::string& path, const std::vector<float>& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data.data()),
            static_cast<std::streamsize>(data.size() * sizeof(float)));
  if (!out) fcp::throwInvalidArgument("cannot write ", path);
}

std::vector<Segment> readSegments(std::istream& in) {
  size_t n = 0;
  in >> n;
  std::vector<Segment> segments(n);
  for (Segment& s : segments) in >> s.numTokens >> s.sequenceId >> s.firstPosition;
  return segments;
}

int run(const std::string& dir) {
  std::ifstream spec(dir + "/spec.txt");
  int64_t nq = 0, nk = 0;
  int hq = 0, hkv = 0, d = 0;
  std::string kind, dtypeText;
  spec >> nq >> nk >> hq >> hkv >> d >> kind >> dtypeText;
  const std::vector<Segment> qs = readSegments(spec), ks = readSegments(spec);
  if (!spec) fcp::throwInvalidArgument("malformed ", dir, "/spec.txt");
  const DType dtype = dtypeText == "bf16" ? DType::kBf16 : DType::kFp32;
  const BlockMask mask{kind == "full" ? MaskKind::kFull : MaskKind::kCausal, qs, ks};

  const size_t qn = static_cast<size_t>(nq * hq * d), kn = static_cast<size_t>(nk * hkv * d);
  std::vector<float> q = readFloats(dir + "/q.bin", qn), k = readFloats(dir + "/k.bin", kn),
                     v = readFloats(dir + "/v.bin", kn), dO = readFloats(dir + "/do.bin", qn);
  std::vector<uint16_t> qb(qn), kb(kn), vb(kn), dob(qn);
  for (size_t i = 0; i < qn; ++i) qb[i] = toBf16(q[i]), dob[i] = toBf16(dO[i]);
  for (size_t i = 0; i < kn; ++i) kb[i] = toBf16(k[i]), vb[i] = toBf16(v[i]);
  auto view = [&](const std::vector<float>& f, const std::vector<uint16_t>& b, int64_t n, int h) {
    return dtype == DType::kBf16 ? TensorView{b.data(), n, h, d, dtype}
                                 : TensorView{f.data(), n, h, d, dtype};
  };
  const TensorView qv = view(q, qb, nq, hq), kv = view(k, kb, nk, hkv), vv = view(v, vb, nk, hkv),
                   dov = view(dO, dob, nq, hq);

  std::vector<float> o(qn), lse(nq * hq), delta(nq * hq), dq(qn), dk(kn), dv(kn);
  forward(qv, kv, vv, mask, o.data(), lse.data());
  computeDelta({o.data(), nq, hq, d, DType::kFp32}, dov, delta.data());
  backward(qv, kv, vv, dov, lse.data(), delta.data(), mask, dq.data(), dk.data(), dv.data());
  writeFloats(dir + "/o.bin", o);
  writeFloats(dir + "/lse.bin", lse);
  writeFloats(dir + "/dq.bin", dq);
  writeFloats(dir + "/dk.bin", dk);
  writeFloats(dir + "/dv.bin", dv);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fcp_kernels_torch_helper DIR\n";
    return 2;
  }
  try {
    return run(argv[1]);
  } catch (const std::exception& e) {
    std::cerr << "fcp_kernels_torch_helper: " << e.what() << "\n";
    return 1;
  }
}
