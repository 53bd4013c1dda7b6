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

// The first slot whose running end passes q (ends ascend over the SLOTS
// slots, each at [s / 4][s % 4]): q's slot, by binary search.
fn slot_of(q: u32, ends: array<vec4<u32>, 32>) -> u32 {
    var s = 0u;
    var hi = SLOTS - 1u;
    while s < hi {
        let mid = (s + hi) / 2u;
        if q < ends[mid / 4u][mid % 4u] {
            hi = mid;
        } else {
            s = mid + 1u;
        }
    }
    return s;
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

// ---- finite check + unscale + sum of squares: up to SLOTS gradients per
// dispatch, each in place: gradient s: (n_s), the elements of fc_g from
// off[s]; flag: one u32 shared by all of them; partials: one f32 per chunk of
// `chunk` values, from `offset`, gradient after gradient ----
// One invocation per chunk of the dispatch's gradients, numbered gradient
// after gradient (chunk q is in the first slot s with q < end[s], the running
// count of chunks), so q = grid_index(wg, groups, lane) writes partial
// offset + q as one dispatch per gradient did. It walks its chunk in order
// (the sum of squares' order, reduce.wgsl chunk_sum_squares). Each value is
// tested *before* the multiply on its exponent bits (all ones = inf or NaN;
// WGSL has no isNan/isInf), then multiplied by inv_scale (a power of two:
// exact) and its square added by fma. The host zeroes the flag, runs this
// over all the gradients (those laid side by side in one buffer, as the
// trainer lays them out, in one dispatch; others one buffer a dispatch),
// and reads the flag and the partials back together. A slot the host leaves
// unused has n = 0 and its end the last one's.

// Gradients (AdamW: parameters) one dispatch takes: the parameters'
// per-slot arrays fill a uniform buffer of 32 vec4s each.
const SLOTS: u32 = 128u;

struct CheckParams {
    c: u32, // f32 bits
    chunk: u32,
    offset: u32,
    _pad: u32,
    // per slot s, at [s / 4][s % 4]: its offset in fc_g, its length (0:
    // unused) and the running count of chunks through it
    off: array<vec4<u32>, 32>,
    n: array<vec4<u32>, 32>,
    end: array<vec4<u32>, 32>,
}

@group(0) @binding(0) var<uniform> fc_prm: CheckParams;
@group(0) @binding(1) var<storage, read_write> fc_flag: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> fc_partials: array<f32>;
@group(0) @binding(3) var<storage, read_write> fc_g: array<f32>;

fn fc_end(s: u32) -> u32 {
    return fc_prm.end[s / 4u][s % 4u];
}

@compute @workgroup_size(64)
fn finite_check_unscale(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                        @builtin(local_invocation_index) lane: u32) {
    let q = grid_index(wg, groups, lane);
    if q >= fc_end(SLOTS - 1u) {
        return;
    }
    // q's slot: the first whose chunks end past q
    let s = slot_of(q, fc_prm.end);
    var before = 0u;
    if s > 0u {
        before = fc_end(s - 1u);
    }
    let at = fc_prm.off[s / 4u][s % 4u];
    let n = fc_prm.n[s / 4u][s % 4u];
    let start = (q - before) * fc_prm.chunk;
    let end = min(start + fc_prm.chunk, n);
    let c = bitcast<f32>(fc_prm.c);
    var bad = false;
    var acc = -0.0;
    for (var i = start; i < end; i++) {
        let x = fc_g[at + i];
        bad = bad || is_nonfinite_bits(bitcast<u32>(x));
        let u = x * c;
        fc_g[at + i] = u;
        acc = fma_c(u, u, acc);
    }
    fc_partials[fc_prm.offset + q] = acc;
    if bad {
        atomicOr(&fc_flag, 1u); // only the rare bad lanes touch the atomic
    }
}

// ---- AdamW: up to SLOTS parameters a dispatch, in place (PyTorch's formula) ----
// p1 = p * decay; m = fma_c(beta1, m, omb1 * g); v = fma_c(beta2, v, omb2 * (g * g));
// den = div(sqrt(v), bc2_sqrt) + eps; p = fma_c(-step_size, div(m, den), p1).
// Slot s: its parameter, both moments and its gradient are n_s elements of
// aw_p, aw_m, aw_v and aw_g from element off[s] (laid out alike: one offset
// for all four). The dispatch's elements are numbered over the slots in
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
    // per slot s, at [s / 4][s % 4]
    off: array<vec4<u32>, 32>,
    end: array<vec4<u32>, 32>,
    step_size: array<vec4<u32>, 32>,
    bc2_sqrt: array<vec4<u32>, 32>,
}

@group(0) @binding(0) var<uniform> aw_prm: AdamWParams;
@group(0) @binding(1) var<storage, read_write> aw_p: array<f32>;
@group(0) @binding(2) var<storage, read_write> aw_m: array<f32>;
@group(0) @binding(3) var<storage, read_write> aw_v: array<f32>;
@group(0) @binding(4) var<storage, read_write> aw_g: array<f32>;

fn aw_end(s: u32) -> u32 {
    return aw_prm.end[s / 4u][s % 4u];
}

@compute @workgroup_size(64)
fn adamw_step(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
              @builtin(local_invocation_index) lane: u32) {
    let base = chunk_base(wg, groups) + lane;
    let total = aw_end(SLOTS - 1u);
    if base >= total {
        return;
    }
    let decay = bitcast<f32>(aw_prm.decay);
    let beta1 = bitcast<f32>(aw_prm.beta1);
    let omb1 = bitcast<f32>(aw_prm.omb1);
    let beta2 = bitcast<f32>(aw_prm.beta2);
    let omb2 = bitcast<f32>(aw_prm.omb2);
    let eps = bitcast<f32>(aw_prm.eps);
    // the first element's slot; the lane's later elements lie in it or
    // after it
    var s = slot_of(base, aw_prm.end);
    // The slot's constants, prepared when the slot changes; the bias
    // correction's divisor once per slot (= m_div(x, bc2_sqrt) bit for bit).
    var slot = SLOTS;
    var step_size = 0.0;
    var bc2 = divisor_new(1.0);
    for (var t = 0u; t < PER_LANE; t++) {
        let i = base + t * 64u;
        if i >= total {
            return;
        }
        while i >= aw_end(s) {
            s += 1u;
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
        let at = aw_prm.off[s / 4u][s % 4u] + i - start;
        var gi = aw_g[at];
        if aw_prm.scale_grad != 0u {
            gi = gi * bitcast<f32>(aw_prm.grad_scale);
            aw_g[at] = gi;
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
