"""ESTIMATES (no GPU measured them) of the DBN CUDA data-side kernels before and after issue 23.

    python benchmarks/gpu/estimate_dbn_data_kernels.py            # markdown table, fp32 data

Times of the gram kernel (forward: Xc Xc^T; backward: dY Xc^T and sum dY) and of the apply kernel
(forward: W (x - mu); backward: W (dY - mean dY) + B Xc) on an H200-class GPU, from the launch
plans (old: dbn_cuda.cu at b0b8b2f1; new: this branch, mirrored below), flop and access counts
and the register counts ptxas reported (nvcc 13.0, -O3, sm_90, fp32 data). A roofline with
latency terms, not a simulation: expect 2-3x either way. The device run of
benchmarks/gpu/bench_gpu.py is what measures them.

Model (per kernel): t = launch + max(compute, L2 traffic, DRAM traffic, latency chain), where
  compute     = the busiest SM's work: ceil(blocks / SMs) blocks' instructions at the bound below;
  old kernels = shared-memory (and L1) load bound: each multiply-add loads two scalars, one
                load instruction per clock per SM, i.e. 16 FMA/clk/SM of 128 (1/8 of fp32 peak);
                the old gram also re-gathers its columns once per 4096 entries (D = 512: 64 times);
  new kernels = FMA bound at 60% of 128 FMA/clk/SM (4 x 4 register blocks: 16 FMA per two
                16-byte shared loads, 3 shared wavefronts per 16 FMA warp instructions);
  gathers     = sectors moved: the old order (threads along columns) moves one 32-byte sector per
                element when S = 1 (4 useful bytes of fp32), the new order (threads along
                channels) moves only useful bytes; L2 at 10 TB/s, DRAM at 4.8 TB/s (x once when it
                fits in the 50 MB L2, else once per re-read);
  latency     = waves x serial steps per block x 0.6 us (a panel's global round trip + barriers;
                the apply kernel's D/32 (D/16 for D <= 32) steps per column panel at 0.3 us:
                L2 hits);
  launch      = 3 us per kernel (the new split reduction is one more launch when it runs).
"""
import argparse
import math

SMS, CLK = 132, 1.98e9
FMA_PER_CLK = 128              # fp32 lanes per SM
L2_BW, DRAM_BW, L2_BYTES = 10e12, 4.8e12, 50e6
LAUNCH = 3e-6
REGS = 65536
MAX_PARTIAL = 2 << 20          # kMaxPartialDoubles (unchanged)

# ptxas registers (fp32 data), nvcc 13.0 -O3 sm_90
OLD_REGS = {"gram": 48, "apply": 32}
NEW_REGS = {("gram", False, 16): 48, ("gram", False, 32): 50, ("gram", False, 64): 64,
            ("gram", True, 16): 64, ("gram", True, 32): 59, ("gram", True, 64): 48,
            ("apply", False, 16): 80, ("apply", False, 32): 80, ("apply", False, 64): 94,
            ("apply", True, 16): 79, ("apply", True, 32): 61, ("apply", True, 64): 59}


def cdiv(a, b):
    return -(-a // b)


def bps(regs, smem):
    """Resident 256-thread blocks per SM (registers in units of 8, 228 KB shared memory)."""
    by_regs = REGS // (cdiv(regs, 8) * 8 * 256)
    by_smem = (228 * 1024) // (smem + 1024)
    return max(1, min(8, by_regs, by_smem))


# ------------------------------------------------------------------------------------------------
# Old kernels (one gram block per (group, chunk) computing up to 4096 entries per pass; apply one
# output per thread with D loads of M and D shared loads)

def old_panel_k(D, panels):
    K = 64
    while K > 1 and panels * D * (K + 1) * 4 + K * 8 > 40 * 1024:
        K //= 2
    return K


def old_gram(G, D, m, S, bwd):
    panels = 2 if bwd else 1
    K = old_panel_k(D, panels)
    smem = cdiv(K * 8, 16) * 16 + panels * D * (K + 1) * 4
    wave = SMS * bps(OLD_REGS["gram"], smem)
    E = D * D + (D if bwd else 0)
    want = max(1, cdiv(wave, G))
    want = min(want, max(1, m // (4 * K)), max(1, MAX_PARTIAL // (G * E)))
    cols = cdiv(m, want)
    chunks = cdiv(m, cols)
    blocks = G * chunks
    passes = cdiv(E, 4096)
    per_thread_fma = cdiv(E, 256) * cols
    lds_clk = 8 * per_thread_fma * 2                    # 8 warps, 2 loads per FMA, 1 per clock
    amp = 8 if S == 1 else 1                            # sectors per useful byte (fp32)
    gather_bytes = passes * panels * D * cols * 4 * amp  # per block
    per_sm = cdiv(blocks, SMS)
    compute = per_sm * lds_clk / CLK
    l2 = max(per_sm * gather_bytes / (L2_BW / SMS), G * passes * panels * D * m * 4 * amp / L2_BW)
    x_bytes = G * D * m * 4 * panels
    dram = x_bytes * amp * (passes if x_bytes > L2_BYTES else 1) / DRAM_BW
    waves = cdiv(blocks, wave)
    latency = waves * passes * cdiv(cols, K) * 0.6e-6
    return LAUNCH + max(compute, l2, dram, latency), blocks


def old_apply(G, D, m, S, two):
    panels = 2 if two else 1
    K = old_panel_k(D, panels)
    smem = cdiv(K * 8, 16) * 16 + panels * D * (K + 1) * 4
    wave = SMS * bps(OLD_REGS["apply"], smem)
    ab = max(1, cdiv(2 * wave, G))
    ab = min(ab, max(1, cdiv(m, K)), 65535)
    cols = cdiv(m, ab)
    blocks = G * cdiv(m, cols)
    fma_block = D * cols * D * panels
    per_sm = cdiv(blocks, SMS)
    compute = per_sm * fma_block / 16 / CLK             # 2 loads per FMA: 16 FMA/clk/SM
    amp = 8 if S == 1 else 1
    dram = G * D * m * 4 * (panels + 1) * amp / DRAM_BW  # gathers + stores
    latency = cdiv(blocks, wave) * cdiv(cols, K) * 0.6e-6
    return LAUNCH + max(compute, dram, latency), blocks


# ------------------------------------------------------------------------------------------------
# New kernels (mirror of make_plan in dbn_cuda.cu)

def tile_for(D):
    return 16 if D <= 16 else 32 if D <= 32 else 64


def new_gram(G, D, m, S, bwd):
    E = D * D + (D if bwd else 0)
    best = None
    tt = tile_for(D)
    while tt >= 16:
        bk = 1024 // tt
        tiles = cdiv(D, tt)
        pairs = tiles * tiles if bwd else tiles * (tiles + 1) // 2
        smem = bk * 8 + 2 * bk * (tt + 4) * 4
        wave = SMS * bps(NEW_REGS[("gram", bwd, tt)], smem)
        want = max(1, cdiv(wave, G * pairs))
        want = min(want, max(1, m // (2 * bk)), max(1, MAX_PARTIAL // (G * E)), 65535)
        cols = cdiv(cdiv(m, want), bk) * bk
        chunks = cdiv(m, cols)
        blocks = G * pairs * chunks
        if best is None or blocks > best[0]:
            best = (blocks, tt, tiles, pairs, cols, chunks, wave, bk)
        if blocks >= wave:
            break
        tt //= 2
    blocks, tt, tiles, pairs, cols, chunks, wave, bk = best
    fma_block = tt * tt * cols
    per_sm = cdiv(blocks, SMS)
    compute = per_sm * fma_block / (0.6 * FMA_PER_CLK) / CLK
    reads = 2 * pairs - (0 if bwd else tiles)  # row tiles gathered per chunk (diagonal: one)
    l2 = G * chunks * reads * tt * cols * 4 / L2_BW
    x_bytes = G * D * m * 4 * (2 if bwd else 1)
    dram = x_bytes / DRAM_BW
    latency = cdiv(blocks, wave) * cdiv(cols, bk) * 0.6e-6
    t = LAUNCH + max(compute, l2, dram, latency)
    if chunks > 1 and G < SMS and chunks * E >= 1 << 16:  # gram_reduce_kernel
        t += LAUNCH + (G * chunks * E + G * E) * 8 / DRAM_BW
    return t, blocks


def new_apply(G, D, m, S, two):
    tt = tile_for(D)
    bn = 4096 // tt
    tiles = cdiv(D, tt)
    ldx = bn + 4
    ks = 32 if tt == 64 else 16
    smem = bn * 8 + max(ks * (tt + 4 + ldx), tt * ldx) * 4
    wave = SMS * bps(NEW_REGS[("apply", two, tt)], smem)
    ab = max(1, cdiv(2 * wave, G * tiles))
    ab = min(ab, cdiv(m, bn), 65535)
    cols = cdiv(cdiv(m, ab), bn) * bn
    blocks = G * tiles * cdiv(m, cols)
    prods = 2 if two else 1
    steps = cdiv(D, ks) * prods
    fma_block = tt * bn * ks * steps * cdiv(cols, bn)
    per_sm = cdiv(blocks, SMS)
    compute = per_sm * fma_block / (0.6 * FMA_PER_CLK) / CLK
    l2 = G * tiles * (D * m * prods + cdiv(m, bn) * tt * D * prods) * 4 / L2_BW
    dram = G * D * m * 4 * (prods + 1) / DRAM_BW
    latency = cdiv(blocks, wave) * cdiv(cols, bn) * steps * 0.3e-6
    return LAUNCH + max(compute, l2, dram, latency), blocks


def fmt(t):
    return f"{t * 1e3:.3f}" if t < 1 else f"{t:.2f} s"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args()
    print("ESTIMATES, fp32 data, H200-class (132 SMs, 4.8 TB/s, 67 TFLOP/s fp32); ms, "
          "old -> new (blocks old -> new)\n")
    print("| G | D | N x S | gram fwd | gram bwd | apply fwd | apply bwd |")
    print("|---|---|---|---|---|---|---|")
    for m, S, label in ((64, 1, "64 x 1"), (2 * 64 * 64, 4096, "2 x 4096")):
        for G in (1, 8, 32):
            for D in (16, 64, 128, 256, 512):
                cells = []
                for old, new, flag in ((old_gram, new_gram, False), (old_gram, new_gram, True),
                                       (old_apply, new_apply, False), (old_apply, new_apply, True)):
                    to, bo = old(G, D, m, S, flag)
                    tn, bn = new(G, D, m, S, flag)
                    cells.append(f"{fmt(to)} -> {fmt(tn)} ({bo} -> {bn})")
                print(f"| {G} | {D} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
