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

// ---- scatter-add: g (count, d), CSR (rowptr (v+1), list) -> y: (v, d) ----
// The host builds, for every output row r, the ascending list of the i with
// ids[i] == r (list[rowptr[r] .. rowptr[r+1]]). Each output element is owned by
// one invocation and sums its contributions in that order from +0.0 — exactly
// the CPU's `out = 0; out = out + g[i]` for i ascending.

struct ScatterParams {
    v: u32,
    d: u32,
    skip: u32, // this pass sums list entries [rowptr[r] + skip, + CHUNK); skip > 0 continues from y
    chunk: u32,
}

// Lavapipe (llvmpipe) silently stops a shader after 65,535 loop iterations: the
// host runs rows with more contributions than `chunk` in several passes, each
// continuing from the running sum the last one stored. The order is unchanged.

@group(0) @binding(0) var<storage, read> sc_prm: ScatterParams;
@group(0) @binding(1) var<storage, read> sc_g: array<f32>;
@group(0) @binding(2) var<storage, read> sc_rowptr: array<u32>;
@group(0) @binding(3) var<storage, read> sc_list: array<u32>;
@group(0) @binding(4) var<storage, read_write> sc_y: array<f32>;

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
    sc_y[t] = acc;
}
