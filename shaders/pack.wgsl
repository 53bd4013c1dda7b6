// pack.wgsl — 16-bit storage (needs the prelude's cast.wgsl, which has
// `half_bits` and `widen_bits`): the twin of pack/cpu.rs, integer steps only.
// Word i holds value 2i in its low half and value 2i + 1 in its high half.
// 1-D grids of 64-wide workgroups: i = grid_index(wg, groups, lane).

struct PackParams {
    n: u32,   // values
    fmt: u32, // FMT_BF16 or FMT_FP16
}

// ---- pack: up to three buffers a dispatch, x_s: (n_s) f32 -> w_s:
// (ceil(n_s/2)) words. One invocation per word index i, for every slot with
// a word i (a slot the host leaves unused has n = 0 and another slot's
// buffers bound to it, never touched). Autograd keeps attention's q, k and v
// (and SwiGLU's gate and up) in one dispatch. ----

struct PackSlotParams {
    fmt: u32,
    n: array<u32, 3>, // each slot's values (0: unused)
}

@group(0) @binding(0) var<storage, read> pm_prm: PackSlotParams;
@group(0) @binding(1) var<storage, read> pm_x0: array<f32>;
@group(0) @binding(2) var<storage, read> pm_x1: array<f32>;
@group(0) @binding(3) var<storage, read> pm_x2: array<f32>;
@group(0) @binding(4) var<storage, read_write> pm_w0: array<u32>;
@group(0) @binding(5) var<storage, read_write> pm_w1: array<u32>;
@group(0) @binding(6) var<storage, read_write> pm_w2: array<u32>;

fn pm_load(s: u32, e: u32) -> f32 {
    switch s {
        case 0u: { return pm_x0[e]; }
        case 1u: { return pm_x1[e]; }
        default: { return pm_x2[e]; }
    }
}

fn pm_store(s: u32, i: u32, w: u32) {
    switch s {
        case 0u: { pm_w0[i] = w; }
        case 1u: { pm_w1[i] = w; }
        default: { pm_w2[i] = w; }
    }
}

@compute @workgroup_size(64)
fn pack(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    let fmt = pm_prm.fmt;
    for (var s = 0u; s < 3u; s++) {
        let n = pm_prm.n[s];
        if 2u * i < n {
            var w = half_bits(pm_load(s, 2u * i), fmt);
            if 2u * i + 1u < n {
                w = w | (half_bits(pm_load(s, 2u * i + 1u), fmt) << 16u);
            }
            pm_store(s, i, w);
        }
    }
}

// ---- unpack: w: (ceil(n/2)) words -> y: (n) f32 bit patterns ----

@group(0) @binding(0) var<storage, read> u_prm: PackParams;
@group(0) @binding(1) var<storage, read> u_w: array<u32>;
@group(0) @binding(2) var<storage, read_write> u_y: array<u32>;

@compute @workgroup_size(64)
fn unpack(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
          @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= u_prm.n {
        return;
    }
    let h = (u_w[i / 2u] >> (16u * (i & 1u))) & 0xffffu;
    u_y[i] = widen_bits(h, u_prm.fmt);
}

// ---- unpack_strided: w: words of 16-bit values -> y: (shape) f32 bit patterns ----
// y[i] = value offset + Σ_d idx_d · strides[d] (idx: i's row-major multi-index
// over shape, 6 axes, leading ones of size 1): copy.wgsl's strided_copy of the
// unpacked values, without writing those out.

struct UnpackStridedParams {
    n: u32,
    fmt: u32,
    offset: u32,
    _pad0: u32,
    shape: array<u32, 6>,
    strides: array<u32, 6>,
}

@group(0) @binding(0) var<storage, read> us_prm: UnpackStridedParams;
@group(0) @binding(1) var<storage, read> us_w: array<u32>;
@group(0) @binding(2) var<storage, read_write> us_y: array<u32>;

@compute @workgroup_size(64)
fn unpack_strided(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                  @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= us_prm.n {
        return;
    }
    var rest = i;
    var e = us_prm.offset;
    for (var d = 5; d >= 0; d--) {
        let s = us_prm.shape[d];
        e += (rest % s) * us_prm.strides[d];
        rest = rest / s;
    }
    let h = (us_w[e / 2u] >> (16u * (e & 1u))) & 0xffffu;
    us_y[i] = widen_bits(h, us_prm.fmt);
}
