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
