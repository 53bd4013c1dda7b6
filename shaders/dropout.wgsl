// rng.wgsl — Philox4x32-10 (Salmon et al., 2011), the twin of src/rng.rs, and
// the dropout mask built on it. WGSL has no 64-bit integers: the 32x32->64
// products are assembled from 16-bit halves, and the 64-bit block counter
// offset + i/4 is added with an explicit carry.

const PH_M0: u32 = 0xD2511F53u;
const PH_M1: u32 = 0xCD9E8D57u;
const PH_W0: u32 = 0x9E3779B9u;
const PH_W1: u32 = 0xBB67AE85u;

// mulhi32 (the high half of a 32x32-bit product) comes with the math prelude (fma.wgsl).

// Ten Philox rounds on one 128-bit counter block.
fn philox4x32(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var round = 0; round < 10; round++) {
        if round > 0 {
            k = vec2<u32>(k.x + PH_W0, k.y + PH_W1);
        }
        let hi0 = mulhi32(PH_M0, c.x);
        let lo0 = PH_M0 * c.x;
        let hi1 = mulhi32(PH_M1, c.z);
        let lo1 = PH_M1 * c.z;
        c = vec4<u32>(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// uniform01(u) = (u >> 8) * 2^-24: 24 random bits, exact in f32.
fn uniform01(u: u32) -> f32 {
    return f32(u >> 8u) * 0x1p-24f;
}

// ---- dropout mask: (n) -> mask: (n), mask[i] = scale if uniform01(draw(i)) >= p else 0 ----
// One invocation per Philox block of four draws: block b = offset + b (64-bit),
// draw i = block i/4, word i%4 — the CPU's draw_u32(seed, offset, i).

struct DropoutParams {
    n: u32,
    p: u32,      // f32 bits
    scale: u32,  // f32 bits
    seed_lo: u32,
    seed_hi: u32,
    off_lo: u32,
    off_hi: u32,
}

@group(0) @binding(0) var<storage, read> d_prm: DropoutParams;
@group(0) @binding(1) var<storage, read_write> d_y: array<f32>;

@compute @workgroup_size(64)
fn dropout_mask(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                @builtin(local_invocation_index) lane: u32) {
    let blk = grid_index(wg, groups, lane);
    let n = d_prm.n;
    if blk >= (n + 3u) / 4u {
        return;
    }
    let lo = d_prm.off_lo + blk;
    let hi = d_prm.off_hi + select(0u, 1u, lo < blk); // carry of the 64-bit add
    let r = philox4x32(vec4<u32>(lo, hi, 0u, 0u), vec2<u32>(d_prm.seed_lo, d_prm.seed_hi));
    let p = bitcast<f32>(d_prm.p);
    let scale = bitcast<f32>(d_prm.scale);
    for (var w = 0u; w < 4u; w++) {
        let i = blk * 4u + w;
        if i < n {
            d_y[i] = select(0.0, scale, uniform01(r[w]) >= p);
        }
    }
}
