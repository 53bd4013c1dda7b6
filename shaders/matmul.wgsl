// matmul.wgsl — batched C[b] = op(A[b]) @ op(B[b]) (needs the math prelude: fma_c, cast).
// a: (batch, m, k) or, with trans_a, (batch, k, m); b: (batch, k, n) or, with
// trans_b, (batch, n, k); a batch stride of 0 broadcasts one matrix -> c: (batch, m, n).
//
// The contract, per output: acc = +0.0; for p in 0..k ascending:
// acc = fma(round(a[i,p]), round(b[p,j]), acc); c = round(acc). Each
// invocation owns a 4x4 register tile of outputs (4 rows x one vec4 of
// columns) and runs the whole k loop itself: tiles split rows and columns,
// never k. No shared memory and no barriers (on lavapipe they cost more than
// they save). Out-of-range rows/columns load a clamped in-range element and
// are never stored, so ragged shapes need no padding.

struct MatmulParams {
    m: u32,
    k: u32,
    n: u32,
    trans_a: u32,
    trans_b: u32,
    a_bs: u32,     // batch strides in elements (0 = broadcast)
    b_bs: u32,
    fmt: u32,      // FMT_* applied to operands as loaded and to the output
    batch0: u32,   // first batch of this dispatch (grids are split at 65535)
}

@group(0) @binding(0) var<storage, read> prm: MatmulParams;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

fn load_a(base: u32, i: u32, p: u32) -> f32 {
    var idx: u32;
    if prm.trans_a != 0u {
        idx = base + p * prm.m + i;
    } else {
        idx = base + i * prm.k + p;
    }
    return round_fmt(a[idx], prm.fmt);
}

fn load_b(base: u32, p: u32, j: u32) -> f32 {
    var idx: u32;
    if prm.trans_b != 0u {
        idx = base + j * prm.k + p;
    } else {
        idx = base + p * prm.n + j;
    }
    return round_fmt(b[idx], prm.fmt);
}

// fma(a, b[c], acc[c]) for the four columns of a tile row.
//
// With rounded operands (fmt != none) the product of two bf16 values (8+8
// significant bits) or two fp16 values (11+11 bits, exponents >= 2^-48) is
// exact in f32, so `a * b + acc` rounds once whether or not the device fuses:
// the device's own `fma` is then bit-exact even where it is not fused
// (lavapipe), and much faster than the integer emulation `fma_c` may be.
// The pipeline for rounded operands sets EXACT_PRODUCTS, so the other branch
// (and the emulation) is compiled out of it.
override EXACT_PRODUCTS: bool = false;

fn fma4(a: f32, b: vec4<f32>, acc: vec4<f32>) -> vec4<f32> {
    if EXACT_PRODUCTS {
        return fma(vec4<f32>(a), b, acc);
    }
    return vec4<f32>(fma_c(a, b.x, acc.x), fma_c(a, b.y, acc.y),
                     fma_c(a, b.z, acc.z), fma_c(a, b.w, acc.w));
}

// grid: (ceil(n/32), ceil(m/32), batches); workgroup 8x8 invocations of 4x4 outputs.
@compute @workgroup_size(8, 8, 1)
fn matmul(@builtin(global_invocation_id) gid: vec3<u32>) {
    let m = prm.m;
    let n = prm.n;
    let k = prm.k;
    let i0 = gid.y * 4u;
    let j0 = gid.x * 4u;
    if i0 >= m || j0 >= n {
        return;
    }
    let bi = prm.batch0 + gid.z;
    let a_base = bi * prm.a_bs;
    let b_base = bi * prm.b_bs;
    // Clamped row/column indices for loads past the edge (their results are dropped).
    let r1 = min(i0 + 1u, m - 1u);
    let r2 = min(i0 + 2u, m - 1u);
    let r3 = min(i0 + 3u, m - 1u);
    let c1 = min(j0 + 1u, n - 1u);
    let c2 = min(j0 + 2u, n - 1u);
    let c3 = min(j0 + 3u, n - 1u);
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var p = 0u; p < k; p++) {
        let bv = vec4<f32>(load_b(b_base, p, j0), load_b(b_base, p, c1),
                           load_b(b_base, p, c2), load_b(b_base, p, c3));
        // one fused multiply-add (one rounding) per output and p
        acc0 = fma4(load_a(a_base, i0, p), bv, acc0);
        acc1 = fma4(load_a(a_base, r1, p), bv, acc1);
        acc2 = fma4(load_a(a_base, r2, p), bv, acc2);
        acc3 = fma4(load_a(a_base, r3, p), bv, acc3);
    }
    let out = bi * m * n;
    for (var r = 0u; r < 4u; r++) {
        let i = i0 + r;
        if i >= m {
            break;
        }
        var acc: vec4<f32>;
        switch r {
            case 0u: { acc = acc0; }
            case 1u: { acc = acc1; }
            case 2u: { acc = acc2; }
            default: { acc = acc3; }
        }
        for (var cc = 0u; cc < 4u; cc++) {
            let j = j0 + cc;
            if j >= n {
                break;
            }
            c[out + i * n + j] = round_fmt(acc[cc], prm.fmt);
        }
    }
}
