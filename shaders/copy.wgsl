// copy.wgsl — data movement (no arithmetic, so nothing here can change bits).
// 1-D grids: i = grid_index(wg, groups, lane).

// ---- strided copy: x viewed as (d0..d5) with element strides -> y: (d0*..*d5) contiguous ----
// y[i] = x[offset + Σ idx[d] * strides[d]], idx the row-major multi-index of i
// (dims padded on the left with size 1). Transpose, permute, slice and
// broadcast-expand are all this one kernel.

struct StridedParams {
    n: u32,
    offset: u32,
    _pad0: u32,
    _pad1: u32,
    shape: array<u32, 6>,
    strides: array<u32, 6>,
}

@group(0) @binding(0) var<storage, read> st_prm: StridedParams;
@group(0) @binding(1) var<storage, read> st_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> st_y: array<f32>;

@compute @workgroup_size(64)
fn strided_copy(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= st_prm.n {
        return;
    }
    var rest = i;
    var src = st_prm.offset;
    for (var d = 5; d >= 0; d--) {
        let s = st_prm.shape[d];
        src += (rest % s) * st_prm.strides[d];
        rest = rest / s;
    }
    st_y[i] = st_x[src];
}

// ---- concat, one dispatch per part: part (outer, seg) -> y (outer, row) at column dst ----
// seg = size_p * inner, row = (Σ sizes) * inner, dst = (Σ_{q<p} size_q) * inner.

struct ConcatParams {
    outer: u32,
    seg: u32,
    row: u32,
    dst: u32,
}

@group(0) @binding(0) var<storage, read> cc_prm: ConcatParams;
@group(0) @binding(1) var<storage, read> cc_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> cc_y: array<f32>;

@compute @workgroup_size(64)
fn concat_part(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
               @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= cc_prm.outer * cc_prm.seg {
        return;
    }
    let o = i / cc_prm.seg;
    let j = i % cc_prm.seg;
    cc_y[o * cc_prm.row + cc_prm.dst + j] = cc_x[i];
}

// gather.wgsl — embedding rows (no float atomics anywhere: deterministic).
// 1-D grids: i = grid_index(wg, groups, lane).

// ---- gather: table (v, d), ids (count) -> y: (count, d), row i = table[ids[i]] ----

struct GatherParams {
    count: u32,
    d: u32,
}

@group(0) @binding(0) var<storage, read> g_prm: GatherParams;
@group(0) @binding(1) var<storage, read> g_table: array<f32>;
@group(0) @binding(2) var<storage, read> g_ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> g_y: array<f32>;

@compute @workgroup_size(64)
fn gather_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
               @builtin(local_invocation_index) lane: u32) {
    let t = grid_index(wg, groups, lane);
    let d = g_prm.d;
    if t >= g_prm.count * d {
        return;
    }
    let i = t / d;
    let c = t % d;
    g_y[t] = g_table[g_ids[i] * d + c];
}

// ---- scatter-add: g (count, d), CSR (rowptr (v+1), list) [, e: (v, d)] -> y: (v, d) ----
// The host builds, for every output row r, the ascending list of the i with
// ids[i] == r (list[rowptr[r] .. rowptr[r+1]]). Each output element is owned by
// one invocation and sums its contributions in that order from +0.0 — exactly
// the CPU's `out = 0; out = out + g[i]` for i ascending. With `add`, the last
// pass stores e + the sum: the gradient gathered so far, added as an add of
// its own would add it (gradient accumulation without that add).

struct ScatterParams {
    v: u32,
    d: u32,
    skip: u32, // this pass sums list entries [rowptr[r] + skip, + CHUNK); skip > 0 continues from y
    chunk: u32,
    add: u32, // 1 on the last pass: y = e + the sum
}

// Lavapipe (llvmpipe) silently stops a shader after 65,535 loop iterations: the
// host runs rows with more contributions than `chunk` in several passes, each
// continuing from the running sum the last one stored. The order is unchanged.

@group(0) @binding(0) var<storage, read> sc_prm: ScatterParams;
@group(0) @binding(1) var<storage, read> sc_g: array<f32>;
@group(0) @binding(2) var<storage, read> sc_rowptr: array<u32>;
@group(0) @binding(3) var<storage, read> sc_list: array<u32>;
@group(0) @binding(4) var<storage, read_write> sc_y: array<f32>;
@group(0) @binding(5) var<storage, read> sc_e: array<f32>;

@compute @workgroup_size(64)
fn scatter_add_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                    @builtin(local_invocation_index) lane: u32) {
    let t = grid_index(wg, groups, lane);
    let d = sc_prm.d;
    if t >= sc_prm.v * d {
        return;
    }
    let r = t / d;
    let c = t % d;
    var acc = 0.0;
    if sc_prm.skip > 0u {
        acc = sc_y[t];
    }
    let q_end = sc_rowptr[r + 1u];
    let q_start = sc_rowptr[r] + sc_prm.skip;
    for (var q = q_start; q < min(q_end, q_start + sc_prm.chunk); q++) {
        acc = acc + sc_g[sc_list[q] * d + c];
    }
    if sc_prm.add != 0u {
        sc_y[t] = sc_e[t] + acc;
    } else {
        sc_y[t] = acc;
    }
}
