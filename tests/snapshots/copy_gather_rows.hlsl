struct NagaConstants {
    int first_vertex;
    int first_instance;
    uint other;
};
ConstantBuffer<NagaConstants> _NagaConstants: register(b0);

struct GatherParams {
    uint count;
    uint d;
};

ByteAddressBuffer g_prm : register(t0);
ByteAddressBuffer g_table : register(t1);
ByteAddressBuffer g_ids : register(t2);
RWByteAddressBuffer g_y : register(u0);

uint grid_index(uint3 wg_1, uint3 groups_1, uint lane_1)
{
    return ((((wg_1.y * groups_1.x) + wg_1.x) * 64u) + lane_1);
}

uint naga_div(uint lhs, uint rhs) {
    return lhs / (rhs == 0u ? 1u : rhs);
}

uint naga_mod(uint lhs, uint rhs) {
    return lhs % (rhs == 0u ? 1u : rhs);
}

[numthreads(64, 1, 1)]
void gather_rows(uint3 wg : SV_GroupID, uint3 groups : SV_GroupID, uint lane : SV_GroupIndex)
{
    const uint _e3 = grid_index(wg, uint3(_NagaConstants.first_vertex, _NagaConstants.first_instance, _NagaConstants.other), lane);
    uint d = asuint(g_prm.Load(4));
    uint _e9 = asuint(g_prm.Load(0));
    if ((_e3 >= (_e9 * d))) {
        return;
    }
    uint i = naga_div(_e3, d);
    uint c = naga_mod(_e3, d);
    uint _e19 = asuint(g_ids.Load(i*4));
    precise float _e23 = asfloat(g_table.Load(((_e19 * d) + c)*4));
    g_y.Store(_e3*4, asuint(_e23));
    return;
}
