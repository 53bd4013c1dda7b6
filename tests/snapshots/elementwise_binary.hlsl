struct NagaConstants {
    int first_vertex;
    int first_instance;
    uint other;
};
ConstantBuffer<NagaConstants> _NagaConstants: register(b0);

struct MantExp {
    uint m;
    int e;
};

struct Frexp {
    float m;
    int e;
};

struct Divisor {
    uint bits;
    float mb;
    int eb;
    float r;
};

struct BinaryParams {
    uint n;
    uint op;
    uint _pad0_;
    uint _pad1_;
    uint shape[6];
    uint ls[6];
    uint rs[6];
};

static const uint QNAN = 2143289344u;
static const float M8_17_ = -0.47058824;
static const float C24_17_ = 1.4117647;
static const float R5040_ = 0.0001984127;
static const float R720_ = 0.0013888889;
static const float R120_ = 0.008333334;
static const float R24_ = 0.041666668;
static const float R6_ = 0.16666667;
static const float T13_ = 0.15384616;
static const float T11_ = 0.18181819;
static const float T9_ = 0.22222222;
static const float T7_ = 0.2857143;
static const float T5_ = 0.4;
static const float T3_ = 0.6666667;
static const float LOG2E = 1.442695;
static const float SQRT2_ = 1.4142135;
static const float LN2_HI = 0.69314575;
static const float LN2_LO = 1.4286068e-6;
static const float EXP_HI = 88.72284;
static const float EXP_LO = -103.97209;
static const uint FMT_NONE = 0u;
static const uint FMT_BF16_ = 1u;
static const uint FMT_FP16_ = 2u;
static const uint FP8_E4M3_ = 0u;
static const uint FP8_E5M2_ = 1u;
static const uint U_NEG = 0u;
static const uint U_EXP = 1u;
static const uint U_LOG = 2u;
static const uint U_SQRT = 3u;
static const uint U_RSQRT = 4u;
static const uint U_RECIP = 5u;
static const uint U_SIGMOID = 6u;
static const uint U_SILU = 7u;
static const uint U_SILU_GRAD = 8u;
static const uint U_ABS = 9u;
static const uint U_RELU = 10u;
static const uint U_STEP = 11u;
static const uint U_SQUARE = 12u;
static const uint U_ADD_SCALAR = 13u;
static const uint U_MUL_SCALAR = 14u;
static const uint U_DIV_SCALAR = 15u;
static const uint U_SCALAR_DIV = 16u;
static const uint U_ROUND = 17u;
static const uint U_ROUND_FP8_ = 18u;
static const uint B_ADD = 0u;
static const uint B_SUB = 1u;
static const uint B_MUL = 2u;
static const uint B_DIV = 3u;
static const uint B_MAXIMUM = 4u;
static const uint B_EQ = 5u;

ByteAddressBuffer b_prm : register(t0);
ByteAddressBuffer b_lhs : register(t1);
ByteAddressBuffer b_rhs : register(t2);
RWByteAddressBuffer b_y : register(u0);

uint grid_index(uint3 wg_1, uint3 groups_1, uint lane_1)
{
    return ((((wg_1.y * groups_1.x) + wg_1.x) * 64u) + lane_1);
}

MantExp ConstructMantExp(uint arg0, int arg1) {
    MantExp ret = (MantExp)0;
    ret.m = arg0;
    ret.e = arg1;
    return ret;
}

MantExp fs_unpack(uint a)
{
    uint ex_1 = (a >> 23u);
    uint fr = (a & 8388607u);
    if ((ex_1 == 0u)) {
        const MantExp mantexp = ConstructMantExp(fr, int(-149));
        return mantexp;
    }
    const MantExp mantexp_1 = ConstructMantExp((fr | 8388608u), asint(asuint(int(ex_1)) - asuint(int(150))));
    return mantexp_1;
}

uint mulhi32_(uint a_1, uint b)
{
    uint al = (a_1 & 65535u);
    uint ah = (a_1 >> 16u);
    uint bl = (b & 65535u);
    uint bh = (b >> 16u);
    uint ll = (al * bl);
    uint lh = (al * bh);
    uint hl = (ah * bl);
    uint hh = (ah * bh);
    uint mid = (((ll >> 16u) + (lh & 65535u)) + (hl & 65535u));
    return (((hh + (lh >> 16u)) + (hl >> 16u)) + (mid >> 16u));
}

uint u64_clz(uint2 x)
{
    if ((x.y != 0u)) {
        return (31u - firstbithigh(x.y));
    }
    return (32u + (31u - firstbithigh(x.x)));
}

uint2 u64_shl(uint2 x_1, uint s)
{
    if ((s == 0u)) {
        return x_1;
    }
    if ((s >= 32u)) {
        return uint2(0u, (x_1.x << (s - 32u)));
    }
    return uint2((x_1.x << s), ((x_1.y << s) | (x_1.x >> (32u - s))));
}

bool u64_lt(uint2 a_2, uint2 b_1)
{
    bool local = (bool)0;
    bool local_1 = (bool)0;

    if (!((a_2.y < b_1.y))) {
        if ((a_2.y == b_1.y)) {
            local_1 = (a_2.x < b_1.x);
        } else {
            local_1 = false;
        }
        bool _e17 = local_1;
        local = _e17;
    } else {
        local = true;
    }
    bool _e19 = local;
    return _e19;
}

uint2 u64_shr_sticky(uint2 x_2, uint s_1)
{
    uint2 r = (uint2)0;
    uint lost = (uint)0;

    if ((s_1 == 0u)) {
        return x_2;
    }
    if ((s_1 >= 64u)) {
        return uint2((((x_2.x | x_2.y) != 0u) ? 1u : 0u), 0u);
    }
    if ((s_1 >= 32u)) {
        uint t = (s_1 - 32u);
        r = uint2((x_2.y >> t), 0u);
        lost = (x_2.x | (x_2.y & ((1u << t) - 1u)));
    } else {
        r = uint2(((x_2.x >> s_1) | (x_2.y << (32u - s_1))), (x_2.y >> s_1));
        lost = (x_2.x & ((1u << s_1) - 1u));
    }
    uint _e50 = lost;
    if ((_e50 != 0u)) {
        uint _e55 = r.x;
        r.x = (_e55 | 1u);
    }
    uint2 _e58 = r;
    return _e58;
}

uint2 u64_add(uint2 a_3, uint2 b_2)
{
    uint lo = (a_3.x + b_2.x);
    return uint2(lo, ((a_3.y + b_2.y) + ((lo < a_3.x) ? 1u : 0u)));
}

uint2 u64_sub(uint2 a_4, uint2 b_3)
{
    return uint2((a_4.x - b_3.x), ((a_4.y - b_3.y) - ((a_4.x < b_3.x) ? 1u : 0u)));
}

float fma_soft(float a_5, float b_4, float c)
{
    bool local_2 = (bool)0;
    bool local_3 = (bool)0;
    bool local_4 = (bool)0;
    bool local_5 = (bool)0;
    bool local_6 = (bool)0;
    bool local_7 = (bool)0;
    uint2 x_3 = (uint2)0;
    int ex = (int)0;
    uint sx = (uint)0;
    uint2 y = (uint2)0;
    int ey = (int)0;
    uint sy = (uint)0;
    bool local_8 = (bool)0;
    bool local_9 = (bool)0;
    bool local_10 = (bool)0;
    uint shift = 40u;
    uint m = 0u;
    uint2 rem = (uint2)0;
    uint2 half_ = uint2(0u, 2147483648u);
    bool local_11 = (bool)0;
    bool local_12 = (bool)0;
    bool local_13 = (bool)0;
    uint bits = (uint)0;

    uint ab = asuint(a_5);
    uint bb = asuint(b_4);
    uint cb = asuint(c);
    uint sp = ((ab ^ bb) & 2147483648u);
    uint sc = (cb & 2147483648u);
    uint aa = (ab & 2147483647u);
    uint ba = (bb & 2147483647u);
    uint ca = (cb & 2147483647u);
    if (!((aa > 2139095040u))) {
        local_2 = (ba > 2139095040u);
    } else {
        local_2 = true;
    }
    bool _e25 = local_2;
    if (!(_e25)) {
        local_3 = (ca > 2139095040u);
    } else {
        local_3 = true;
    }
    bool _e32 = local_3;
    if (_e32) {
        precise float fop0_ = asfloat(2143289344u);
        return fop0_;
    }
    if (!((aa == 2139095040u))) {
        local_4 = (ba == 2139095040u);
    } else {
        local_4 = true;
    }
    bool _e43 = local_4;
    if (_e43) {
        if (!((aa == 0u))) {
            local_5 = (ba == 0u);
        } else {
            local_5 = true;
        }
        bool _e52 = local_5;
        if (_e52) {
            precise float fop1_ = asfloat(2143289344u);
            return fop1_;
        }
        if ((ca == 2139095040u)) {
            local_6 = (sc != sp);
        } else {
            local_6 = false;
        }
        bool _e61 = local_6;
        if (_e61) {
            precise float fop2_ = asfloat(2143289344u);
            return fop2_;
        }
        precise float fop3_ = asfloat((sp | 2139095040u));
        return fop3_;
    }
    if ((ca == 2139095040u)) {
        return c;
    }
    if (!((aa == 0u))) {
        local_7 = (ba == 0u);
    } else {
        local_7 = true;
    }
    bool _e77 = local_7;
    if (_e77) {
        if ((ca == 0u)) {
            precise float fop4_ = asfloat((sp & sc));
            return fop4_;
        }
        return c;
    }
    const MantExp _e82 = fs_unpack(aa);
    const MantExp _e83 = fs_unpack(ba);
    const uint _e89 = mulhi32_(_e82.m, _e83.m);
    x_3 = uint2((_e82.m * _e83.m), _e89);
    uint2 _e92 = x_3;
    const uint _e93 = u64_clz(_e92);
    uint2 _e94 = x_3;
    const uint2 _e97 = u64_shl(_e94, (_e93 - 1u));
    x_3 = _e97;
    ex = asint(asuint(asint(asuint(_e82.e) + asuint(_e83.e))) - asuint(int((_e93 - 1u))));
    sx = sp;
    if ((ca != 0u)) {
        const MantExp _e109 = fs_unpack(ca);
        y = uint2(_e109.m, 0u);
        uint2 _e114 = y;
        const uint _e115 = u64_clz(_e114);
        uint2 _e116 = y;
        const uint2 _e119 = u64_shl(_e116, (_e115 - 1u));
        y = _e119;
        ey = asint(asuint(_e109.e) - asuint(int((_e115 - 1u))));
        sy = sc;
        int _e127 = ey;
        int _e128 = ex;
        if (!((_e127 > _e128))) {
            int _e133 = ey;
            int _e134 = ex;
            if ((_e133 == _e134)) {
                uint2 _e138 = x_3;
                uint2 _e139 = y;
                const bool _e140 = u64_lt(_e138, _e139);
                local_9 = _e140;
            } else {
                local_9 = false;
            }
            bool _e142 = local_9;
            local_8 = _e142;
        } else {
            local_8 = true;
        }
        bool _e144 = local_8;
        if (_e144) {
            uint2 tx = x_3;
            uint2 _e146 = y;
            x_3 = _e146;
            y = tx;
            int te = ex;
            int _e148 = ey;
            ex = _e148;
            ey = te;
            uint ts = sx;
            uint _e150 = sy;
            sx = _e150;
            sy = ts;
        }
        uint2 _e151 = y;
        int _e152 = ex;
        int _e153 = ey;
        const uint2 _e156 = u64_shr_sticky(_e151, uint(asint(asuint(_e152) - asuint(_e153))));
        uint _e157 = sx;
        uint _e158 = sy;
        if ((_e157 == _e158)) {
            uint2 _e160 = x_3;
            const uint2 _e161 = u64_add(_e160, _e156);
            x_3 = _e161;
        } else {
            uint2 _e162 = x_3;
            const uint2 _e163 = u64_sub(_e162, _e156);
            x_3 = _e163;
        }
        uint _e165 = x_3.x;
        if ((_e165 == 0u)) {
            uint _e171 = x_3.y;
            local_10 = (_e171 == 0u);
        } else {
            local_10 = false;
        }
        bool _e175 = local_10;
        if (_e175) {
            return 0.0;
        }
    }
    uint2 _e177 = x_3;
    const uint _e178 = u64_clz(_e177);
    uint2 _e179 = x_3;
    const uint2 _e180 = u64_shl(_e179, _e178);
    x_3 = _e180;
    int _e181 = ex;
    int e_top = asint(asuint(asint(asuint(_e181) - asuint(int(_e178)))) + asuint(int(63)));
    if ((e_top > int(127))) {
        uint _e188 = sx;
        precise float fop5_ = asfloat((_e188 | 2139095040u));
        return fop5_;
    }
    if ((e_top < int(-126))) {
        shift = uint(asint(asuint(int(-86)) - asuint(e_top)));
    }
    uint _e199 = shift;
    if ((_e199 > 64u)) {
        uint _e202 = sx;
        precise float fop6_ = asfloat(_e202);
        return fop6_;
    }
    uint2 _e206 = x_3;
    rem = _e206;
    uint _e212 = shift;
    if ((_e212 < 64u)) {
        uint _e215 = shift;
        uint t_1 = (_e215 - 32u);
        uint _e219 = x_3.y;
        m = (_e219 >> t_1);
        uint _e222 = x_3.x;
        uint _e224 = x_3.y;
        rem = uint2(_e222, (_e224 & ((1u << t_1) - 1u)));
        half_ = uint2(0u, (1u << (t_1 - 1u)));
    }
    uint2 _e237 = half_;
    uint2 _e238 = rem;
    const bool _e239 = u64_lt(_e237, _e238);
    if (!(_e239)) {
        uint _e244 = rem.x;
        uint _e246 = half_.x;
        if ((_e244 == _e246)) {
            uint _e251 = rem.y;
            uint _e253 = half_.y;
            local_12 = (_e251 == _e253);
        } else {
            local_12 = false;
        }
        bool _e256 = local_12;
        if (_e256) {
            uint _e259 = m;
            local_13 = ((_e259 & 1u) == 1u);
        } else {
            local_13 = false;
        }
        bool _e265 = local_13;
        local_11 = _e265;
    } else {
        local_11 = true;
    }
    bool _e267 = local_11;
    if (_e267) {
        uint _e268 = m;
        m = (_e268 + 1u);
    }
    if ((e_top < int(-126))) {
        uint _e274 = m;
        bits = _e274;
    } else {
        uint _e280 = m;
        bits = ((uint(asint(asuint(e_top) + asuint(int(126)))) << 23u) + _e280);
    }
    uint _e282 = bits;
    if ((_e282 >= 2139095040u)) {
        uint _e285 = sx;
        precise float fop7_ = asfloat((_e285 | 2139095040u));
        return fop7_;
    }
    uint _e289 = sx;
    uint _e290 = bits;
    precise float fop8_ = asfloat((_e289 | _e290));
    return fop8_;
}

float fma_c(float a_6, float b_5, float c_1)
{
    precise const float _e3 = fma_soft(a_6, b_5, c_1);
    return _e3;
}

bool is_nan_bits(uint b_6)
{
    return ((b_6 & 2147483647u) > 2139095040u);
}

float scale2_(float x_4, int n)
{
    bool local_14 = (bool)0;
    uint q = (uint)0;
    bool local_15 = (bool)0;
    bool local_16 = (bool)0;

    uint b_11 = asuint(x_4);
    int field = int(((b_11 >> 23u) & 255u));
    if (!((field == int(0)))) {
        local_14 = (field == int(255));
    } else {
        local_14 = true;
    }
    bool _e16 = local_14;
    if (_e16) {
        return x_4;
    }
    uint sign_ = (b_11 & 2147483648u);
    int f = asint(asuint(field) + asuint(n));
    if ((f >= int(255))) {
        precise float fop9_ = asfloat((sign_ | 2139095040u));
        return fop9_;
    }
    if ((f >= int(1))) {
        precise float fop10_ = asfloat(((sign_ | (uint(f) << 23u)) | (b_11 & 8388607u)));
        return fop10_;
    }
    uint sig = ((b_11 & 8388607u) | 8388608u);
    uint s_3 = uint(min(asint(asuint(int(1)) - asuint(f)), int(25)));
    q = (sig >> s_3);
    uint rem_1 = (sig & ((1u << s_3) - 1u));
    uint half_1 = (1u << (s_3 - 1u));
    if (!((rem_1 > half_1))) {
        if ((rem_1 == half_1)) {
            uint _e62 = q;
            local_16 = ((_e62 & 1u) == 1u);
        } else {
            local_16 = false;
        }
        bool _e68 = local_16;
        local_15 = _e68;
    } else {
        local_15 = true;
    }
    bool _e70 = local_15;
    if (_e70) {
        uint _e71 = q;
        q = (_e71 + 1u);
    }
    uint _e74 = q;
    precise float fop11_ = asfloat((sign_ | _e74));
    return fop11_;
}

Frexp ConstructFrexp(float arg0, int arg1) {
    Frexp ret = (Frexp)0;
    ret.m = arg0;
    ret.e = arg1;
    return ret;
}

Frexp frexp_abs(float x_5)
{
    uint bits_1 = (uint)0;
    uint s_2 = 0u;

    bits_1 = (asuint(x_5) & 2147483647u);
    uint _e7 = bits_1;
    if ((_e7 < 8388608u)) {
        uint _e10 = bits_1;
        s_2 = ((31u - firstbithigh(_e10)) - 8u);
        uint _e14 = bits_1;
        uint _e15 = s_2;
        bits_1 = (_e14 << _e15);
    }
    uint _e17 = bits_1;
    uint _e23 = s_2;
    int e = asint(asuint(asint(asuint(int((_e17 >> 23u))) - asuint(int(127)))) - asuint(int(_e23)));
    uint _e26 = bits_1;
    precise float m_1 = asfloat(((_e26 & 8388607u) | 1065353216u));
    const Frexp frexp_ = ConstructFrexp(m_1, e);
    return frexp_;
}

float divisor_div(Divisor dv, float a_7)
{
    bool local_17 = (bool)0;

    uint ab_1 = asuint(a_7);
    uint bb_1 = dv.bits;
    uint sign_1 = ((ab_1 ^ bb_1) & 2147483648u);
    uint aa_1 = (ab_1 & 2147483647u);
    uint ba_1 = (bb_1 & 2147483647u);
    const bool _e11 = is_nan_bits(ab_1);
    if (!(_e11)) {
        const bool _e15 = is_nan_bits(bb_1);
        local_17 = _e15;
    } else {
        local_17 = true;
    }
    bool _e17 = local_17;
    if (_e17) {
        precise float fop12_ = asfloat(QNAN);
        return fop12_;
    }
    if ((ba_1 == 2139095040u)) {
        if ((aa_1 == 2139095040u)) {
            precise float fop13_ = asfloat(QNAN);
            return fop13_;
        }
        precise float fop14_ = asfloat(sign_1);
        return fop14_;
    }
    if ((ba_1 == 0u)) {
        if ((aa_1 == 0u)) {
            precise float fop15_ = asfloat(QNAN);
            return fop15_;
        }
        precise float fop16_ = asfloat((sign_1 | 2139095040u));
        return fop16_;
    }
    if ((aa_1 == 2139095040u)) {
        precise float fop17_ = asfloat((sign_1 | 2139095040u));
        return fop17_;
    }
    if ((aa_1 == 0u)) {
        precise float fop18_ = asfloat(sign_1);
        return fop18_;
    }
    const Frexp _e44 = frexp_abs(a_7);
    precise float ma = _e44.m;
    precise float q0_ = (ma * dv.r);
    precise float fop19_ = -(q0_);
    precise const float _e50 = fma_c(fop19_, dv.mb, ma);
    precise const float _e52 = fma_c(_e50, dv.r, q0_);
    int d_1 = asint(asuint(_e44.e) - asuint(dv.eb));
    if ((d_1 > int(128))) {
        precise float fop20_ = asfloat((sign_1 | 2139095040u));
        return fop20_;
    }
    if ((d_1 < int(-151))) {
        precise float fop21_ = asfloat(sign_1);
        return fop21_;
    }
    precise const float _e64 = scale2_(_e52, d_1);
    precise float fop22_ = asfloat((asuint(_e64) | sign_1));
    return fop22_;
}

Divisor ConstructDivisor(uint arg0, float arg1, int arg2, float arg3) {
    Divisor ret = (Divisor)0;
    ret.bits = arg0;
    ret.mb = arg1;
    ret.eb = arg2;
    ret.r = arg3;
    return ret;
}

Divisor divisor_new(float b_7)
{
    precise float r_1 = (float)0;

    const Frexp _e1 = frexp_abs(b_7);
    precise float mb = _e1.m;
    precise const float _e5 = fma_c(M8_17_, mb, C24_17_);
    r_1 = _e5;
    precise float _e7 = r_1;
    precise float fop23_ = -(mb);
    precise float _e9 = r_1;
    precise const float _e11 = fma_c(fop23_, _e9, 1.0);
    precise float _e12 = r_1;
    precise const float _e13 = fma_c(_e7, _e11, _e12);
    r_1 = _e13;
    precise float _e14 = r_1;
    precise float fop24_ = -(mb);
    precise float _e16 = r_1;
    precise const float _e18 = fma_c(fop24_, _e16, 1.0);
    precise float _e19 = r_1;
    precise const float _e20 = fma_c(_e14, _e18, _e19);
    r_1 = _e20;
    precise float _e21 = r_1;
    precise float fop25_ = -(mb);
    precise float _e23 = r_1;
    precise const float _e25 = fma_c(fop25_, _e23, 1.0);
    precise float _e26 = r_1;
    precise const float _e27 = fma_c(_e21, _e25, _e26);
    r_1 = _e27;
    precise float _e30 = r_1;
    const Divisor divisor = ConstructDivisor(asuint(b_7), mb, _e1.e, _e30);
    return divisor;
}

float m_div(float a_8, float b_8)
{
    const Divisor _e2 = divisor_new(b_8);
    precise const float _e3 = divisor_div(_e2, a_8);
    return _e3;
}

float maximum_c(float a_9, float b_9)
{
    bool local_18 = (bool)0;
    bool local_19 = (bool)0;
    bool local_20 = (bool)0;

    const bool _e3 = is_nan_bits(asuint(a_9));
    if (_e3) {
        return a_9;
    } else {
        const bool _e5 = is_nan_bits(asuint(b_9));
        if (!(_e5)) {
            local_18 = (b_9 > a_9);
        } else {
            local_18 = true;
        }
        bool _e11 = local_18;
        if (_e11) {
            return b_9;
        } else {
            if ((a_9 == b_9)) {
                local_19 = (a_9 == 0.0);
            } else {
                local_19 = false;
            }
            bool _e18 = local_19;
            if (_e18) {
                local_20 = (b_9 == 0.0);
            } else {
                local_20 = false;
            }
            bool _e24 = local_20;
            if (_e24) {
                precise float fop26_ = (a_9 + b_9);
                return fop26_;
            }
        }
    }
    return a_9;
}

float binary_elem(float a_10, float b_10, uint op)
{
    switch(op) {
        case 0u: {
            precise float fop27_ = (a_10 + b_10);
            return fop27_;
        }
        case 1u: {
            precise float fop28_ = (a_10 - b_10);
            return fop28_;
        }
        case 2u: {
            precise float fop29_ = (a_10 * b_10);
            return fop29_;
        }
        case 3u: {
            precise const float _e6 = m_div(a_10, b_10);
            return _e6;
        }
        case 4u: {
            precise const float _e7 = maximum_c(a_10, b_10);
            return _e7;
        }
        case 5u: {
            if ((a_10 == b_10)) {
                return 1.0;
            }
            return 0.0;
        }
        default: {
            precise float fop30_ = asfloat(QNAN);
            return fop30_;
        }
    }
}

uint naga_mod(uint lhs, uint rhs) {
    return lhs % (rhs == 0u ? 1u : rhs);
}

uint naga_div(uint lhs, uint rhs) {
    return lhs / (rhs == 0u ? 1u : rhs);
}

[numthreads(64, 1, 1)]
void binary(uint3 wg : SV_GroupID, uint3 groups : SV_GroupID, uint lane : SV_GroupIndex)
{
    uint rest = (uint)0;
    uint li = 0u;
    uint ri = 0u;
    int d = int(5);

    const uint _e3 = grid_index(wg, uint3(_NagaConstants.first_vertex, _NagaConstants.first_instance, _NagaConstants.other), lane);
    uint _e6 = asuint(b_prm.Load(0));
    if ((_e3 >= _e6)) {
        return;
    }
    rest = _e3;
    uint2 loop_bound = uint2(4294967295u, 4294967295u);
    bool loop_init = true;
    while(true) {
        if (all(loop_bound == uint2(0u, 0u))) { break; }
        loop_bound -= uint2(loop_bound.y == 0u, 1u);
        if (!loop_init) {
            int _e44 = d;
            d = asint(asuint(_e44) - asuint(int(1)));
        }
        loop_init = false;
        int _e15 = d;
        if ((_e15 >= int(0))) {
        } else {
            break;
        }
        {
            int _e20 = d;
            uint s_4 = asuint(b_prm.Load(_e20*4+16));
            uint _e23 = rest;
            uint idx = naga_mod(_e23, s_4);
            uint _e25 = rest;
            rest = naga_div(_e25, s_4);
            uint _e27 = li;
            int _e30 = d;
            uint _e32 = asuint(b_prm.Load(_e30*4+40));
            li = (_e27 + (idx * _e32));
            uint _e35 = ri;
            int _e38 = d;
            uint _e40 = asuint(b_prm.Load(_e38*4+64));
            ri = (_e35 + (idx * _e40));
        }
    }
    uint _e49 = li;
    precise float _e51 = asfloat(b_lhs.Load(_e49*4));
    uint _e53 = ri;
    precise float _e55 = asfloat(b_rhs.Load(_e53*4));
    uint _e58 = asuint(b_prm.Load(4));
    precise const float _e59 = binary_elem(_e51, _e55, _e58);
    b_y.Store(_e3*4, asuint(_e59));
    return;
}
