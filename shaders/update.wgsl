// update.wgsl — in-place optimizer updates and the loss scaler's fused check
// (needs mathlib). Each expression has the shape of the CPU reference's
// (src/backend/update/cpu.rs): explicit fma where the Rust uses mul_add, separate
// ops where it does two roundings.
//
// 1-D grids. scale_in_place and adamw_step give each
// invocation PER_LANE elements: workgroup w covers the 64 * PER_LANE
// consecutive elements from w * 64 * PER_LANE, lane l takes every 64th of them
// from l (neighbouring lanes, neighbouring addresses). PER_LANE is a pipeline
// override chosen per adapter by the host (context.rs `update_per_lane`): many
// per lane on a software device, where each workgroup is a scheduled task and
// one element per lane left the scheduling, not the memory, setting the pace;
// a few on a real GPU, which wants many lanes in flight. The parameters are
// read once per invocation. The SGD kernels keep one element per lane:
// i = grid_index(wg, groups, lane).

override PER_LANE: u32 = 4u;

fn chunk_base(wg: vec3<u32>, groups: vec3<u32>) -> u32 {
    return grid_index(wg, groups, 0u) * PER_LANE;
}

// ---- scale in place: x: (n), x = x * c (gradient clipping) ----

struct ScaleParams {
    n: u32,
    c: u32, // f32 bits
}

@group(0) @binding(0) var<storage, read> sc_prm: ScaleParams;
@group(0) @binding(1) var<storage, read_write> sc_x: array<f32>;

@compute @workgroup_size(64)
fn scale_in_place(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                  @builtin(local_invocation_index) lane: u32) {
    let base = chunk_base(wg, groups) + lane;
    let n = sc_prm.n;
    let c = bitcast<f32>(sc_prm.c);
    for (var t = 0u; t < PER_LANE; t++) {
        let i = base + t * 64u;
        if i >= n {
            return;
        }
        sc_x[i] = sc_x[i] * c;
    }
}

// ---- finite check + unscale + sum of squares: up to five gradients per
// dispatch, each in place: g_s: (n_s); flag: one u32 shared by all buffers;
// partials: one f32 per chunk of `chunk` values, from `offset`, buffer after
// buffer ----
// One invocation per chunk of the dispatch's buffers, numbered buffer after
// buffer (chunk q is in the first buffer s with q < end[s], the running
// count of chunks), so q = grid_index(wg, groups, lane) writes partial offset + q
// as one dispatch per buffer did. It walks its chunk in order (the sum of
// squares' order, reduce.wgsl chunk_sum_squares). Each value is tested
// *before* the multiply on its exponent bits (all ones = inf or NaN; WGSL has
// no isNan/isInf), then multiplied by inv_scale (a power of two: exact) and
// its square added by fma. The host zeroes the flag, runs this over all the
// gradients six at a time (one flag, one partials buffer, six gradients:
// WebGPU's least of eight storage buffers, the parameters a uniform buffer),
// and reads the flag and the partials back together. A slot
// the host leaves unused has n = 0, its end the last one's, and another
// gradient bound to it, never read.

struct CheckParams {
    c: u32, // f32 bits
    chunk: u32,
    offset: u32,
    _pad: u32,
    n: array<vec4<u32>, 2>,   // each slot's length (0: unused), slot s at [s / 4][s % 4]
    end: array<vec4<u32>, 2>, // the running count of chunks through each slot
}

@group(0) @binding(0) var<uniform> fc_prm: CheckParams;
@group(0) @binding(1) var<storage, read_write> fc_flag: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> fc_partials: array<f32>;
@group(0) @binding(3) var<storage, read_write> fc_g0: array<f32>;
@group(0) @binding(4) var<storage, read_write> fc_g1: array<f32>;
@group(0) @binding(5) var<storage, read_write> fc_g2: array<f32>;
@group(0) @binding(6) var<storage, read_write> fc_g3: array<f32>;
@group(0) @binding(7) var<storage, read_write> fc_g4: array<f32>;
@group(0) @binding(8) var<storage, read_write> fc_g5: array<f32>;

fn fc_end(s: u32) -> u32 {
    return fc_prm.end[s / 4u][s % 4u];
}

fn fc_load(s: u32, i: u32) -> f32 {
    switch s {
        case 0u: { return fc_g0[i]; }
        case 1u: { return fc_g1[i]; }
        case 2u: { return fc_g2[i]; }
        case 3u: { return fc_g3[i]; }
        case 4u: { return fc_g4[i]; }
        default: { return fc_g5[i]; }
    }
}

fn fc_store(s: u32, i: u32, v: f32) {
    switch s {
        case 0u: { fc_g0[i] = v; }
        case 1u: { fc_g1[i] = v; }
        case 2u: { fc_g2[i] = v; }
        case 3u: { fc_g3[i] = v; }
        case 4u: { fc_g4[i] = v; }
        default: { fc_g5[i] = v; }
    }
}

@compute @workgroup_size(64)
fn finite_check_unscale(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                        @builtin(local_invocation_index) lane: u32) {
    let q = grid_index(wg, groups, lane);
    if q >= fc_end(5u) {
        return;
    }
    // q's buffer s (the first whose chunks end past q) and the chunks before it
    var s = 0u;
    var before = 0u;
    while q >= fc_end(s) {
        before = fc_end(s);
        s += 1u;
    }
    let n = fc_prm.n[s / 4u][s % 4u];
    let start = (q - before) * fc_prm.chunk;
    let end = min(start + fc_prm.chunk, n);
    let c = bitcast<f32>(fc_prm.c);
    var bad = false;
    var acc = -0.0;
    for (var i = start; i < end; i++) {
        let x = fc_load(s, i);
        bad = bad || is_nonfinite_bits(bitcast<u32>(x));
        let u = x * c;
        fc_store(s, i, u);
        acc = fma_c(u, u, acc);
    }
    fc_partials[fc_prm.offset + q] = acc;
    if bad {
        atomicOr(&fc_flag, 1u); // only the rare bad lanes touch the atomic
    }
}

// ---- AdamW: up to 5 parameters a dispatch, in place (PyTorch's formula) ----
// p1 = p * decay; m = fma_c(beta1, m, omb1 * g); v = fma_c(beta2, v, omb2 * (g * g));
// den = div(sqrt(v), bc2_sqrt) + eps; p = fma_c(-step_size, div(m, den), p1).
// Slot s: its parameter and both moments are n_s elements of aw_p, aw_m and
// aw_v from element off[s] (laid out alike: one offset for all three), its
// gradient aw_g<s>. The dispatch's elements are numbered over the slots in
// order (end[s]: the running count to the end of slot s; an unused slot ends
// where the last used one does). Each element's update is the same whatever
// its slot; only the step size and the bias correction are the slot's.

struct AdamWParams {
    decay: u32, // all f32 bits
    beta1: u32,
    omb1: u32,
    beta2: u32,
    omb2: u32,
    eps: u32,
    scale_grad: u32, // 1: g = g * grad_scale, stored back, before the update (clipping)
    grad_scale: u32,
    zero: u32, // 0: sep's opaque zero
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    // per slot s, at [s / 4][s % 4] (a uniform buffer: the eight storage
    // buffers are the parameters, the moments and five gradients)
    off: array<vec4<u32>, 2>,
    end: array<vec4<u32>, 2>,
    step_size: array<vec4<u32>, 2>,
    bc2_sqrt: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> aw_prm: AdamWParams;
@group(0) @binding(1) var<storage, read_write> aw_p: array<f32>;
@group(0) @binding(2) var<storage, read_write> aw_m: array<f32>;
@group(0) @binding(3) var<storage, read_write> aw_v: array<f32>;
@group(0) @binding(4) var<storage, read_write> aw_g0: array<f32>;
@group(0) @binding(5) var<storage, read_write> aw_g1: array<f32>;
@group(0) @binding(6) var<storage, read_write> aw_g2: array<f32>;
@group(0) @binding(7) var<storage, read_write> aw_g3: array<f32>;
@group(0) @binding(8) var<storage, read_write> aw_g4: array<f32>;

fn aw_end(s: u32) -> u32 {
    return aw_prm.end[s / 4u][s % 4u];
}

fn aw_grad(s: u32, j: u32) -> f32 {
    switch s {
        case 0u: { return aw_g0[j]; }
        case 1u: { return aw_g1[j]; }
        case 2u: { return aw_g2[j]; }
        case 3u: { return aw_g3[j]; }
        default: { return aw_g4[j]; }
    }
}

fn aw_set_grad(s: u32, j: u32, x: f32) {
    switch s {
        case 0u: { aw_g0[j] = x; }
        case 1u: { aw_g1[j] = x; }
        case 2u: { aw_g2[j] = x; }
        case 3u: { aw_g3[j] = x; }
        default: { aw_g4[j] = x; }
    }
}

@compute @workgroup_size(64)
fn adamw_step(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
              @builtin(local_invocation_index) lane: u32) {
    let base = chunk_base(wg, groups) + lane;
    let total = aw_end(4u);
    let decay = bitcast<f32>(aw_prm.decay);
    let beta1 = bitcast<f32>(aw_prm.beta1);
    let omb1 = bitcast<f32>(aw_prm.omb1);
    let beta2 = bitcast<f32>(aw_prm.beta2);
    let omb2 = bitcast<f32>(aw_prm.omb2);
    let eps = bitcast<f32>(aw_prm.eps);
    // The slot's constants, prepared when the slot changes; the bias
    // correction's divisor once per slot (= m_div(x, bc2_sqrt) bit for bit).
    var slot = 5u;
    var step_size = 0.0;
    var bc2 = divisor_new(1.0);
    for (var t = 0u; t < PER_LANE; t++) {
        let i = base + t * 64u;
        if i >= total {
            return;
        }
        var s = 0u;
        for (var e = 0u; e < 4u; e++) {
            if i >= aw_end(e) {
                s = e + 1u;
            }
        }
        if s != slot {
            slot = s;
            step_size = bitcast<f32>(aw_prm.step_size[s / 4u][s % 4u]);
            bc2 = divisor_new(bitcast<f32>(aw_prm.bc2_sqrt[s / 4u][s % 4u]));
        }
        var start = 0u;
        if s > 0u {
            start = aw_end(s - 1u);
        }
        let j = i - start;
        let at = aw_prm.off[s / 4u][s % 4u] + j;
        var gi = aw_grad(s, j);
        if aw_prm.scale_grad != 0u {
            gi = gi * bitcast<f32>(aw_prm.grad_scale);
            aw_set_grad(s, j, gi);
        }
        let p1 = aw_p[at] * decay;
        let mi = fma_c(beta1, aw_m[at], omb1 * gi);
        // g·g rounded before its product with omb2 (sep: not regrouped)
        let vi = fma_c(beta2, aw_v[at], omb2 * sep(gi * gi, aw_prm.zero));
        let den = divisor_div(bc2, m_sqrt(vi)) + eps;
        aw_p[at] = fma_c(-step_size, m_div(mi, den), p1);
        aw_m[at] = mi;
        aw_v[at] = vi;
    }
}

// ---- SGD: p, g (, buf): (n), in place (PyTorch's formula) ----
// g' = fma_c(wd, p, g); with momentum buf = first ? g' : fma_c(momentum, buf, g'),
// g' = buf; p = fma_c(-lr, g', p).

struct SgdParams {
    n: u32,
    lr: u32, // f32 bits
    momentum: u32,
    wd: u32,
    first: u32,
}

@group(0) @binding(0) var<storage, read> sg_prm: SgdParams;
@group(0) @binding(1) var<storage, read_write> sg_p: array<f32>;
@group(0) @binding(2) var<storage, read> sg_g: array<f32>;
@group(0) @binding(3) var<storage, read_write> sg_buf: array<f32>;

@compute @workgroup_size(64)
fn sgd_step(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
            @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= sg_prm.n {
        return;
    }
    let p = sg_p[i];
    let gi = fma_c(bitcast<f32>(sg_prm.wd), p, sg_g[i]);
    sg_p[i] = fma_c(-bitcast<f32>(sg_prm.lr), gi, p);
}

@compute @workgroup_size(64)
fn sgd_momentum_step(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                     @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= sg_prm.n {
        return;
    }
    let p = sg_p[i];
    var gi = fma_c(bitcast<f32>(sg_prm.wd), p, sg_g[i]);
    if sg_prm.first != 0u {
        sg_buf[i] = gi;
    } else {
        sg_buf[i] = fma_c(bitcast<f32>(sg_prm.momentum), sg_buf[i], gi);
    }
    gi = sg_buf[i];
    sg_p[i] = fma_c(-bitcast<f32>(sg_prm.lr), gi, p);
}
