// elementwise.wgsl — unary and broadcasting binary ops (needs mathlib + cast).
// Every op is the CPU reference's (elementwise/cpu.rs `unary_t` / `binary_t`)
// expression for expression, but where a result is decided on bits instead, to
// the same bits (abs; sigmoid where exp overflows, in mathlib's m_sigmoid).
// 1-D problems use a 2-D grid of 64-wide workgroups (65535 groups per
// dimension at most): i = grid_index(wg, groups, lane).

// ---- unary: x: (n) -> y: (n) ----

struct UnaryParams {
    n: u32,
    op: u32,
    c: u32,   // the f32 scalar as bits (AddScalar ... RDivScalar)
    fmt: u32, // FMT_* for Round
}

@group(0) @binding(0) var<storage, read> u_prm: UnaryParams;
@group(0) @binding(1) var<storage, read> u_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> u_y: array<f32>;

// U_* op codes: generated from UnaryOp::code (elementwise/mod.rs).

fn unary_elem(x: f32, op: u32, c: f32, fmt: u32) -> f32 {
    switch op {
        case U_NEG: { return -0.0 - x; }
        case U_EXP: { return m_exp(x); }
        case U_LOG: { return m_log(x); }
        case U_SQRT: { return m_sqrt(x); }
        case U_RSQRT: { return m_div(1.0, m_sqrt(x)); }
        case U_RECIP: { return m_div(1.0, x); }
        case U_SIGMOID: { return m_sigmoid(x); }
        case U_SILU: { return x * m_sigmoid(x); }
        case U_SILU_GRAD: {
            let s = m_sigmoid(x);
            // s * (1 + x * (1 - s)) = s * fma_c(x, 1 - s, 1)
            return s * fma_c(x, 1.0 - s, 1.0);
        }
        case U_ABS: {
            // -0 - x for x < 0 and x = -0, else x (NaN kept as it is): the
            // sign bit cleared, decided on bits. (Testing -0 by 1 / x < 0
            // compared a constant infinity; a negative subnormal through
            // -0 - x would meet a flushing subtraction.)
            let b = bitcast<u32>(x);
            if (b & 0x80000000u) != 0u && !is_nan_bits(b) {
                return bitcast<f32>(b & 0x7fffffffu);
            }
            return x;
        }
        case U_RELU: {
            if x > 0.0 {
                return x;
            } else if is_nan_bits(bitcast<u32>(x)) {
                return x;
            }
            return 0.0;
        }
        case U_STEP: {
            if x > 0.0 {
                return 1.0;
            }
            return 0.0;
        }
        case U_SQUARE: { return x * x; }
        case U_ADD_SCALAR: { return x + c; }
        case U_MUL_SCALAR: { return x * c; }
        case U_DIV_SCALAR: { return m_div(x, c); }
        case U_SCALAR_DIV: { return m_div(c, x); }
        case U_ROUND: { return round_fmt(x, fmt); }
        case U_ROUND_FP8: { return round_fp8(x, fmt); }
        default: { return bitcast<f32>(QNAN); }
    }
}

@compute @workgroup_size(64)
fn unary(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
         @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= u_prm.n {
        return;
    }
    u_y[i] = unary_elem(u_x[i], u_prm.op, bitcast<f32>(u_prm.c), u_prm.fmt);
}

// ---- binary: lhs, rhs broadcast to shape (d0..d5) -> y: (d0*..*d5) ----
// Shapes are padded on the left to 6 dims (size 1, stride 0). Output element i
// is split into its multi-index (row-major), and each input's index is
// Σ idx[d] * stride[d] with stride 0 on broadcast dimensions.

struct BinaryParams {
    n: u32,
    op: u32,
    _pad0: u32,
    _pad1: u32,
    shape: array<u32, 6>,
    ls: array<u32, 6>,
    rs: array<u32, 6>,
}

@group(0) @binding(0) var<storage, read> b_prm: BinaryParams;
@group(0) @binding(1) var<storage, read> b_lhs: array<f32>;
@group(0) @binding(2) var<storage, read> b_rhs: array<f32>;
@group(0) @binding(3) var<storage, read_write> b_y: array<f32>;

// B_* op codes: generated from BinaryOp::code (elementwise/mod.rs).

fn binary_elem(a: f32, b: f32, op: u32) -> f32 {
    switch op {
        case B_ADD: { return a + b; }
        case B_SUB: { return a - b; }
        case B_MUL: { return a * b; }
        case B_DIV: { return m_div(a, b); }
        case B_MAXIMUM: { return maximum_c(a, b); }
        case B_EQ: {
            // IEEE equality: NaN ≠ NaN, +0 = -0
            if a == b {
                return 1.0;
            }
            return 0.0;
        }
        default: { return bitcast<f32>(QNAN); }
    }
}

@compute @workgroup_size(64)
fn binary(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
          @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= b_prm.n {
        return;
    }
    var rest = i;
    var li = 0u;
    var ri = 0u;
    for (var d = 5; d >= 0; d--) {
        let s = b_prm.shape[d];
        let idx = rest % s;
        rest = rest / s;
        li += idx * b_prm.ls[d];
        ri += idx * b_prm.rs[d];
    }
    b_y[i] = binary_elem(b_lhs[li], b_rhs[ri], b_prm.op);
}
