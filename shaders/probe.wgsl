// probe.wgsl — what the numerics contract assumes of a device, measured (the
// cross-check's probe; needs the math prelude: fma_c, m_div, bf16_f32, fp16_f32).
// One invocation per case computes op(a, b, c) on operands read from a
// buffer, so no compiler can fold them, and stores the f32 result as the
// kernels store theirs. P_* op codes are generated from ProbeOp::code.

struct ProbeParams {
    n: u32,
}

@group(0) @binding(0) var<storage, read> prm: ProbeParams;
@group(0) @binding(1) var<storage, read> ops: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>; // a, b, c per case
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn probe(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= prm.n {
        return;
    }
    let a = x[3u * i];
    let b = x[3u * i + 1u];
    let c = x[3u * i + 2u];
    var r = 0.0;
    switch ops[i] {
        case P_COPY: { r = a; }
        case P_BITS: { r = bitcast<f32>(bitcast<u32>(a) ^ bitcast<u32>(b)); }
        case P_ADD: { r = a + b; }
        case P_SUB: { r = a - b; }
        case P_MUL: { r = a * b; }
        case P_FMA: { r = fma(a, b, c); }
        case P_FMA_C: { r = fma_c(a, b, c); }
        case P_MUL_THEN_ADD: {
            // a product and a sum written as two operations: a compiler that
            // contracts them into one fma changes the result
            let p = a * b;
            r = p + c;
        }
        case P_DIV: { r = m_div(a, b); }
        case P_BF16: { r = bf16_f32(a); }
        case P_FP16: { r = fp16_f32(a); }
        case P_FOLD: { r = (a + 8388608.0) - 8388608.0; }
        case P_NATIVE_DIV: { r = a / b; }
        case P_NATIVE_SQRT: { r = sqrt(a); }
        case P_NATIVE_EXP: { r = exp(a); }
        default: { r = 0.0; }
    }
    y[i] = r;
}
