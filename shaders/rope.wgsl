// rope.wgsl — one element of RoPE each way (needs the math prelude's `sep`),
// shared by fused.wgsl's RoPE kernels and attention.wgsl's rotating loads.
// h = d/2; forward, j < h: y = x_j·c_j + (-0 - x_{j+h})·s_j; j >= h:
// y = x_j·c_j + x_{j-h}·s_j.

// One rotated element from its input x_j, its partner (x_{j+h} in the first
// half, x_{j-h} in the second) and its entries c, s of the tables.
fn rope_value(xj: f32, partner: f32, c: f32, s: f32, first_half: bool, z: u32) -> f32 {
    let xc = sep(xj * c, z);
    if first_half {
        return xc + sep((-0.0 - partner) * s, z);
    }
    return xc + sep(partner * s, z);
}

// One element of RoPE's backward from its gradient g_j, its partner's
// (g_{j+h} in the first half, g_{j-h} in the second), c_j and the partner's s.
fn rope_grad(gj: f32, partner: f32, c: f32, s: f32, first_half: bool, z: u32) -> f32 {
    let pz = bitcast<f32>(z); // +0, the narrows' zero padding
    let gc = sep(gj * c, z);
    if first_half {
        return (gc + pz) + sep(partner * s, z);
    }
    return (gc + (-0.0 - sep(partner * s, z))) + pz;
}
