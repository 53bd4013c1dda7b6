// tinyllm: the numerics contract needs safe math and no contraction, which
// MSL 3.2 (macOS 15 / iOS 18) lets the source ask for; an older compiler
// would ignore the pragmas and keep fast math, so it must not compile this.
#if __METAL_VERSION__ < 320
#error "tinyllm: the kernels need MSL 3.2 (macOS 15 / iOS 18) for #pragma METAL fp math_mode(safe)"
#endif
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
// language: metal3.2
#include <metal_stdlib>
#include <simd/simd.h>

using metal::uint;

struct _mslBufferSizes {
    uint size1;
    uint size2;
    uint size3;
};

typedef float type_3[1];
struct GatherParams {
    uint count;
    uint d;
};
typedef uint type_4[1];

uint grid_index(
    metal::uint3 wg_1,
    metal::uint3 groups_1,
    uint lane_1
) {
    return (((wg_1.y * groups_1.x) + wg_1.x) * 64u) + lane_1;
}
uint naga_div(uint lhs, uint rhs) {
    return lhs / metal::select(rhs, 1u, rhs == 0u);
}

uint naga_mod(uint lhs, uint rhs) {
    return lhs % metal::select(rhs, 1u, rhs == 0u);
}


struct gather_rowsInput {
};
constant _mslBufferSizes tinyllm_no_sizes = {};
[[max_total_threads_per_threadgroup(64)]] kernel void gather_rows(
  metal::uint3 wg [[threadgroup_position_in_grid]]
, metal::uint3 groups [[threadgroups_per_grid]]
, uint lane [[thread_index_in_threadgroup]]
, device GatherParams const& g_prm [[buffer(0)]]
, device type_3 const& g_table [[buffer(1)]]
, device type_4 const& g_ids [[buffer(2)]]
, device type_3& g_y [[buffer(3)]]
) {
    constant _mslBufferSizes& _buffer_sizes = tinyllm_no_sizes;
    uint _e3 = grid_index(wg, groups, lane);
    uint d = g_prm.d;
    uint _e9 = g_prm.count;
    if (_e3 >= (_e9 * d)) {
        return;
    }
    uint i = naga_div(_e3, d);
    uint c = naga_mod(_e3, d);
    uint _e19 = g_ids[i];
    float _e23 = g_table[(_e19 * d) + c];
    g_y[_e3] = _e23;
    return;
}
