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
typedef float type_6[1];
struct type_7 {
    uint inner[6];
};
struct BinaryParams {
    uint n;
    uint op;
    uint _pad0_;
    uint _pad1_;
    type_7 shape;
    type_7 ls;
    type_7 rs;
};
constant uint QNAN = 2143289344u;
constant float M8_17_ = -0.47058824;
constant float C24_17_ = 1.4117647;
constant float R5040_ = 0.0001984127;
constant float R720_ = 0.0013888889;
constant float R120_ = 0.008333334;
constant float R24_ = 0.041666668;
constant float R6_ = 0.16666667;
constant float T13_ = 0.15384616;
constant float T11_ = 0.18181819;
constant float T9_ = 0.22222222;
constant float T7_ = 0.2857143;
constant float T5_ = 0.4;
constant float T3_ = 0.6666667;
constant float LOG2E = 1.442695;
constant float SQRT2_ = 1.4142135;
constant float LN2_HI = 0.69314575;
constant float LN2_LO = 0.0000014286068;
constant float EXP_HI = 88.72284;
constant float EXP_LO = -103.97209;
constant uint FMT_NONE = 0u;
constant uint FMT_BF16_ = 1u;
constant uint FMT_FP16_ = 2u;
constant uint FP8_E4M3_ = 0u;
constant uint FP8_E5M2_ = 1u;
constant uint U_NEG = 0u;
constant uint U_EXP = 1u;
constant uint U_LOG = 2u;
constant uint U_SQRT = 3u;
constant uint U_RSQRT = 4u;
constant uint U_RECIP = 5u;
constant uint U_SIGMOID = 6u;
constant uint U_SILU = 7u;
constant uint U_SILU_GRAD = 8u;
constant uint U_ABS = 9u;
constant uint U_RELU = 10u;
constant uint U_STEP = 11u;
constant uint U_SQUARE = 12u;
constant uint U_ADD_SCALAR = 13u;
constant uint U_MUL_SCALAR = 14u;
constant uint U_DIV_SCALAR = 15u;
constant uint U_SCALAR_DIV = 16u;
constant uint U_ROUND = 17u;
constant uint U_ROUND_FP8_ = 18u;
constant uint B_ADD = 0u;
constant uint B_SUB = 1u;
constant uint B_MUL = 2u;
constant uint B_DIV = 3u;
constant uint B_MAXIMUM = 4u;
constant uint B_EQ = 5u;

uint grid_index(
    metal::uint3 wg_1,
    metal::uint3 groups_1,
    uint lane_1
) {
    return (((wg_1.y * groups_1.x) + wg_1.x) * 64u) + lane_1;
}

MantExp fs_unpack(
    uint a
) {
    uint ex_1 = a >> 23u;
    uint fr = a & 8388607u;
    if (ex_1 == 0u) {
        return MantExp {fr, -149};
    }
    return MantExp {fr | 8388608u, as_type<int>(as_type<uint>(static_cast<int>(ex_1)) - as_type<uint>(150))};
}

uint mulhi32_(
    uint a_1,
    uint b
) {
    uint al = a_1 & 65535u;
    uint ah = a_1 >> 16u;
    uint bl = b & 65535u;
    uint bh = b >> 16u;
    uint ll = al * bl;
    uint lh = al * bh;
    uint hl = ah * bl;
    uint hh = ah * bh;
    uint mid = ((ll >> 16u) + (lh & 65535u)) + (hl & 65535u);
    return ((hh + (lh >> 16u)) + (hl >> 16u)) + (mid >> 16u);
}

uint u64_clz(
    metal::uint2 x
) {
    if (x.y != 0u) {
        return metal::clz(x.y);
    }
    return 32u + metal::clz(x.x);
}

metal::uint2 u64_shl(
    metal::uint2 x_1,
    uint s
) {
    if (s == 0u) {
        return x_1;
    }
    if (s >= 32u) {
        return metal::uint2(0u, x_1.x << (s - 32u));
    }
    return metal::uint2(x_1.x << s, (x_1.y << s) | (x_1.x >> (32u - s)));
}

bool u64_lt(
    metal::uint2 a_2,
    metal::uint2 b_1
) {
    bool local = {};
    bool local_1 = {};
    if (!((a_2.y < b_1.y))) {
        if (a_2.y == b_1.y) {
            local_1 = a_2.x < b_1.x;
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

metal::uint2 u64_shr_sticky(
    metal::uint2 x_2,
    uint s_1
) {
    metal::uint2 r = {};
    uint lost = {};
    if (s_1 == 0u) {
        return x_2;
    }
    if (s_1 >= 64u) {
        return metal::uint2(((x_2.x | x_2.y) != 0u) ? 1u : 0u, 0u);
    }
    if (s_1 >= 32u) {
        uint t = s_1 - 32u;
        r = metal::uint2(x_2.y >> t, 0u);
        lost = x_2.x | (x_2.y & ((1u << t) - 1u));
    } else {
        r = metal::uint2((x_2.x >> s_1) | (x_2.y << (32u - s_1)), x_2.y >> s_1);
        lost = x_2.x & ((1u << s_1) - 1u);
    }
    uint _e50 = lost;
    if (_e50 != 0u) {
        uint _e55 = r.x;
        r.x = _e55 | 1u;
    }
    metal::uint2 _e58 = r;
    return _e58;
}

metal::uint2 u64_add(
    metal::uint2 a_3,
    metal::uint2 b_2
) {
    uint lo = a_3.x + b_2.x;
    return metal::uint2(lo, (a_3.y + b_2.y) + ((lo < a_3.x) ? 1u : 0u));
}

metal::uint2 u64_sub(
    metal::uint2 a_4,
    metal::uint2 b_3
) {
    return metal::uint2(a_4.x - b_3.x, (a_4.y - b_3.y) - ((a_4.x < b_3.x) ? 1u : 0u));
}

float fma_soft(
    float a_5,
    float b_4,
    float c
) {
    bool local_2 = {};
    bool local_3 = {};
    bool local_4 = {};
    bool local_5 = {};
    bool local_6 = {};
    bool local_7 = {};
    metal::uint2 x_3 = {};
    int ex = {};
    uint sx = {};
    metal::uint2 y = {};
    int ey = {};
    uint sy = {};
    bool local_8 = {};
    bool local_9 = {};
    bool local_10 = {};
    uint shift = 40u;
    uint m = 0u;
    metal::uint2 rem = {};
    metal::uint2 half_ = metal::uint2(0u, 2147483648u);
    bool local_11 = {};
    bool local_12 = {};
    bool local_13 = {};
    uint bits = {};
    uint ab = as_type<uint>(a_5);
    uint bb = as_type<uint>(b_4);
    uint cb = as_type<uint>(c);
    uint sp = (ab ^ bb) & 2147483648u;
    uint sc = cb & 2147483648u;
    uint aa = ab & 2147483647u;
    uint ba = bb & 2147483647u;
    uint ca = cb & 2147483647u;
    if (!((aa > 2139095040u))) {
        local_2 = ba > 2139095040u;
    } else {
        local_2 = true;
    }
    bool _e25 = local_2;
    if (!(_e25)) {
        local_3 = ca > 2139095040u;
    } else {
        local_3 = true;
    }
    bool _e32 = local_3;
    if (_e32) {
        return as_type<float>(2143289344u);
    }
    if (!((aa == 2139095040u))) {
        local_4 = ba == 2139095040u;
    } else {
        local_4 = true;
    }
    bool _e43 = local_4;
    if (_e43) {
        if (!((aa == 0u))) {
            local_5 = ba == 0u;
        } else {
            local_5 = true;
        }
        bool _e52 = local_5;
        if (_e52) {
            return as_type<float>(2143289344u);
        }
        if (ca == 2139095040u) {
            local_6 = sc != sp;
        } else {
            local_6 = false;
        }
        bool _e61 = local_6;
        if (_e61) {
            return as_type<float>(2143289344u);
        }
        return as_type<float>(sp | 2139095040u);
    }
    if (ca == 2139095040u) {
        return c;
    }
    if (!((aa == 0u))) {
        local_7 = ba == 0u;
    } else {
        local_7 = true;
    }
    bool _e77 = local_7;
    if (_e77) {
        if (ca == 0u) {
            return as_type<float>(sp & sc);
        }
        return c;
    }
    MantExp _e82 = fs_unpack(aa);
    MantExp _e83 = fs_unpack(ba);
    uint _e89 = mulhi32_(_e82.m, _e83.m);
    x_3 = metal::uint2(_e82.m * _e83.m, _e89);
    metal::uint2 _e92 = x_3;
    uint _e93 = u64_clz(_e92);
    metal::uint2 _e94 = x_3;
    metal::uint2 _e97 = u64_shl(_e94, _e93 - 1u);
    x_3 = _e97;
    ex = as_type<int>(as_type<uint>(as_type<int>(as_type<uint>(_e82.e) + as_type<uint>(_e83.e))) - as_type<uint>(static_cast<int>(_e93 - 1u)));
    sx = sp;
    if (ca != 0u) {
        MantExp _e109 = fs_unpack(ca);
        y = metal::uint2(_e109.m, 0u);
        metal::uint2 _e114 = y;
        uint _e115 = u64_clz(_e114);
        metal::uint2 _e116 = y;
        metal::uint2 _e119 = u64_shl(_e116, _e115 - 1u);
        y = _e119;
        ey = as_type<int>(as_type<uint>(_e109.e) - as_type<uint>(static_cast<int>(_e115 - 1u)));
        sy = sc;
        int _e127 = ey;
        int _e128 = ex;
        if (!((_e127 > _e128))) {
            int _e133 = ey;
            int _e134 = ex;
            if (_e133 == _e134) {
                metal::uint2 _e138 = x_3;
                metal::uint2 _e139 = y;
                bool _e140 = u64_lt(_e138, _e139);
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
            metal::uint2 tx = x_3;
            metal::uint2 _e146 = y;
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
        metal::uint2 _e151 = y;
        int _e152 = ex;
        int _e153 = ey;
        metal::uint2 _e156 = u64_shr_sticky(_e151, static_cast<uint>(as_type<int>(as_type<uint>(_e152) - as_type<uint>(_e153))));
        uint _e157 = sx;
        uint _e158 = sy;
        if (_e157 == _e158) {
            metal::uint2 _e160 = x_3;
            metal::uint2 _e161 = u64_add(_e160, _e156);
            x_3 = _e161;
        } else {
            metal::uint2 _e162 = x_3;
            metal::uint2 _e163 = u64_sub(_e162, _e156);
            x_3 = _e163;
        }
        uint _e165 = x_3.x;
        if (_e165 == 0u) {
            uint _e171 = x_3.y;
            local_10 = _e171 == 0u;
        } else {
            local_10 = false;
        }
        bool _e175 = local_10;
        if (_e175) {
            return 0.0;
        }
    }
    metal::uint2 _e177 = x_3;
    uint _e178 = u64_clz(_e177);
    metal::uint2 _e179 = x_3;
    metal::uint2 _e180 = u64_shl(_e179, _e178);
    x_3 = _e180;
    int _e181 = ex;
    int e_top = as_type<int>(as_type<uint>(as_type<int>(as_type<uint>(_e181) - as_type<uint>(static_cast<int>(_e178)))) + as_type<uint>(63));
    if (e_top > 127) {
        uint _e188 = sx;
        return as_type<float>(_e188 | 2139095040u);
    }
    if (e_top < -126) {
        shift = static_cast<uint>(as_type<int>(as_type<uint>(-86) - as_type<uint>(e_top)));
    }
    uint _e199 = shift;
    if (_e199 > 64u) {
        uint _e202 = sx;
        return as_type<float>(_e202);
    }
    metal::uint2 _e206 = x_3;
    rem = _e206;
    uint _e212 = shift;
    if (_e212 < 64u) {
        uint _e215 = shift;
        uint t_1 = _e215 - 32u;
        uint _e219 = x_3.y;
        m = _e219 >> t_1;
        uint _e222 = x_3.x;
        uint _e224 = x_3.y;
        rem = metal::uint2(_e222, _e224 & ((1u << t_1) - 1u));
        half_ = metal::uint2(0u, 1u << (t_1 - 1u));
    }
    metal::uint2 _e237 = half_;
    metal::uint2 _e238 = rem;
    bool _e239 = u64_lt(_e237, _e238);
    if (!(_e239)) {
        uint _e244 = rem.x;
        uint _e246 = half_.x;
        if (_e244 == _e246) {
            uint _e251 = rem.y;
            uint _e253 = half_.y;
            local_12 = _e251 == _e253;
        } else {
            local_12 = false;
        }
        bool _e256 = local_12;
        if (_e256) {
            uint _e259 = m;
            local_13 = (_e259 & 1u) == 1u;
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
        m = _e268 + 1u;
    }
    if (e_top < -126) {
        uint _e274 = m;
        bits = _e274;
    } else {
        uint _e280 = m;
        bits = (static_cast<uint>(as_type<int>(as_type<uint>(e_top) + as_type<uint>(126))) << 23u) + _e280;
    }
    uint _e282 = bits;
    if (_e282 >= 2139095040u) {
        uint _e285 = sx;
        return as_type<float>(_e285 | 2139095040u);
    }
    uint _e289 = sx;
    uint _e290 = bits;
    return as_type<float>(_e289 | _e290);
}

float fma_c(
    float a_6,
    float b_5,
    float c_1
) {
    float _e3 = fma_soft(a_6, b_5, c_1);
    return _e3;
}

bool is_nan_bits(
    uint b_6
) {
    return (b_6 & 2147483647u) > 2139095040u;
}

float scale2_(
    float x_4,
    int n
) {
    bool local_14 = {};
    uint q = {};
    bool local_15 = {};
    bool local_16 = {};
    uint b_11 = as_type<uint>(x_4);
    int field = static_cast<int>((b_11 >> 23u) & 255u);
    if (!((field == 0))) {
        local_14 = field == 255;
    } else {
        local_14 = true;
    }
    bool _e16 = local_14;
    if (_e16) {
        return x_4;
    }
    uint sign = b_11 & 2147483648u;
    int f = as_type<int>(as_type<uint>(field) + as_type<uint>(n));
    if (f >= 255) {
        return as_type<float>(sign | 2139095040u);
    }
    if (f >= 1) {
        return as_type<float>((sign | (static_cast<uint>(f) << 23u)) | (b_11 & 8388607u));
    }
    uint sig = (b_11 & 8388607u) | 8388608u;
    uint s_3 = static_cast<uint>(metal::min(as_type<int>(as_type<uint>(1) - as_type<uint>(f)), 25));
    q = sig >> s_3;
    uint rem_1 = sig & ((1u << s_3) - 1u);
    uint half_1 = 1u << (s_3 - 1u);
    if (!((rem_1 > half_1))) {
        if (rem_1 == half_1) {
            uint _e62 = q;
            local_16 = (_e62 & 1u) == 1u;
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
        q = _e71 + 1u;
    }
    uint _e74 = q;
    return as_type<float>(sign | _e74);
}

Frexp frexp_abs(
    float x_5
) {
    uint bits_1 = {};
    uint s_2 = 0u;
    bits_1 = as_type<uint>(x_5) & 2147483647u;
    uint _e7 = bits_1;
    if (_e7 < 8388608u) {
        uint _e10 = bits_1;
        s_2 = metal::clz(_e10) - 8u;
        uint _e14 = bits_1;
        uint _e15 = s_2;
        bits_1 = _e14 << _e15;
    }
    uint _e17 = bits_1;
    uint _e23 = s_2;
    int e = as_type<int>(as_type<uint>(as_type<int>(as_type<uint>(static_cast<int>(_e17 >> 23u)) - as_type<uint>(127))) - as_type<uint>(static_cast<int>(_e23)));
    uint _e26 = bits_1;
    float m_1 = as_type<float>((_e26 & 8388607u) | 1065353216u);
    return Frexp {m_1, e};
}

float divisor_div(
    Divisor dv,
    float a_7
) {
    bool local_17 = {};
    uint ab_1 = as_type<uint>(a_7);
    uint bb_1 = dv.bits;
    uint sign_1 = (ab_1 ^ bb_1) & 2147483648u;
    uint aa_1 = ab_1 & 2147483647u;
    uint ba_1 = bb_1 & 2147483647u;
    bool _e11 = is_nan_bits(ab_1);
    if (!(_e11)) {
        bool _e15 = is_nan_bits(bb_1);
        local_17 = _e15;
    } else {
        local_17 = true;
    }
    bool _e17 = local_17;
    if (_e17) {
        return as_type<float>(QNAN);
    }
    if (ba_1 == 2139095040u) {
        if (aa_1 == 2139095040u) {
            return as_type<float>(QNAN);
        }
        return as_type<float>(sign_1);
    }
    if (ba_1 == 0u) {
        if (aa_1 == 0u) {
            return as_type<float>(QNAN);
        }
        return as_type<float>(sign_1 | 2139095040u);
    }
    if (aa_1 == 2139095040u) {
        return as_type<float>(sign_1 | 2139095040u);
    }
    if (aa_1 == 0u) {
        return as_type<float>(sign_1);
    }
    Frexp _e44 = frexp_abs(a_7);
    float ma = _e44.m;
    float q0_ = ma * dv.r;
    float _e50 = fma_c(-(q0_), dv.mb, ma);
    float _e52 = fma_c(_e50, dv.r, q0_);
    int d_1 = as_type<int>(as_type<uint>(_e44.e) - as_type<uint>(dv.eb));
    if (d_1 > 128) {
        return as_type<float>(sign_1 | 2139095040u);
    }
    if (d_1 < -151) {
        return as_type<float>(sign_1);
    }
    float _e64 = scale2_(_e52, d_1);
    return as_type<float>(as_type<uint>(_e64) | sign_1);
}

Divisor divisor_new(
    float b_7
) {
    float r_1 = {};
    Frexp _e1 = frexp_abs(b_7);
    float mb = _e1.m;
    float _e5 = fma_c(M8_17_, mb, C24_17_);
    r_1 = _e5;
    float _e7 = r_1;
    float _e9 = r_1;
    float _e11 = fma_c(-(mb), _e9, 1.0);
    float _e12 = r_1;
    float _e13 = fma_c(_e7, _e11, _e12);
    r_1 = _e13;
    float _e14 = r_1;
    float _e16 = r_1;
    float _e18 = fma_c(-(mb), _e16, 1.0);
    float _e19 = r_1;
    float _e20 = fma_c(_e14, _e18, _e19);
    r_1 = _e20;
    float _e21 = r_1;
    float _e23 = r_1;
    float _e25 = fma_c(-(mb), _e23, 1.0);
    float _e26 = r_1;
    float _e27 = fma_c(_e21, _e25, _e26);
    r_1 = _e27;
    float _e30 = r_1;
    return Divisor {as_type<uint>(b_7), mb, _e1.e, _e30};
}

float m_div(
    float a_8,
    float b_8
) {
    Divisor _e2 = divisor_new(b_8);
    float _e3 = divisor_div(_e2, a_8);
    return _e3;
}

float maximum_c(
    float a_9,
    float b_9
) {
    bool local_18 = {};
    bool local_19 = {};
    bool local_20 = {};
    bool _e3 = is_nan_bits(as_type<uint>(a_9));
    if (_e3) {
        return a_9;
    } else {
        bool _e5 = is_nan_bits(as_type<uint>(b_9));
        if (!(_e5)) {
            local_18 = b_9 > a_9;
        } else {
            local_18 = true;
        }
        bool _e11 = local_18;
        if (_e11) {
            return b_9;
        } else {
            if (a_9 == b_9) {
                local_19 = a_9 == 0.0;
            } else {
                local_19 = false;
            }
            bool _e18 = local_19;
            if (_e18) {
                local_20 = b_9 == 0.0;
            } else {
                local_20 = false;
            }
            bool _e24 = local_20;
            if (_e24) {
                return a_9 + b_9;
            }
        }
    }
    return a_9;
}

float binary_elem(
    float a_10,
    float b_10,
    uint op
) {
    switch(op) {
        case 0u: {
            return a_10 + b_10;
        }
        case 1u: {
            return a_10 - b_10;
        }
        case 2u: {
            return a_10 * b_10;
        }
        case 3u: {
            float _e6 = m_div(a_10, b_10);
            return _e6;
        }
        case 4u: {
            float _e7 = maximum_c(a_10, b_10);
            return _e7;
        }
        case 5u: {
            if (a_10 == b_10) {
                return 1.0;
            }
            return 0.0;
        }
        default: {
            return as_type<float>(QNAN);
        }
    }
}
uint naga_mod(uint lhs, uint rhs) {
    return lhs % metal::select(rhs, 1u, rhs == 0u);
}

uint naga_div(uint lhs, uint rhs) {
    return lhs / metal::select(rhs, 1u, rhs == 0u);
}


struct binaryInput {
};
constant _mslBufferSizes tinyllm_no_sizes = {};
[[max_total_threads_per_threadgroup(64)]] kernel void binary(
  metal::uint3 wg [[threadgroup_position_in_grid]]
, metal::uint3 groups [[threadgroups_per_grid]]
, uint lane [[thread_index_in_threadgroup]]
, device BinaryParams const& b_prm [[buffer(0)]]
, device type_6 const& b_lhs [[buffer(1)]]
, device type_6 const& b_rhs [[buffer(2)]]
, device type_6& b_y [[buffer(3)]]
) {
    constant _mslBufferSizes& _buffer_sizes = tinyllm_no_sizes;
    uint rest = {};
    uint li = 0u;
    uint ri = 0u;
    int d = 5;
    uint _e3 = grid_index(wg, groups, lane);
    uint _e6 = b_prm.n;
    if (_e3 >= _e6) {
        return;
    }
    rest = _e3;
    uint2 loop_bound = uint2(4294967295u);
    bool loop_init = true;
    while(true) {
        if (metal::all(loop_bound == uint2(0u))) { break; }
        loop_bound -= uint2(loop_bound.y == 0u, 1u);
        if (!loop_init) {
            int _e44 = d;
            d = as_type<int>(as_type<uint>(_e44) - as_type<uint>(1));
        }
        loop_init = false;
        int _e15 = d;
        if (_e15 >= 0) {
        } else {
            break;
        }
        {
            int _e20 = d;
            uint s_4 = b_prm.shape.inner[_e20];
            uint _e23 = rest;
            uint idx = naga_mod(_e23, s_4);
            uint _e25 = rest;
            rest = naga_div(_e25, s_4);
            uint _e27 = li;
            int _e30 = d;
            uint _e32 = b_prm.ls.inner[_e30];
            li = _e27 + (idx * _e32);
            uint _e35 = ri;
            int _e38 = d;
            uint _e40 = b_prm.rs.inner[_e38];
            ri = _e35 + (idx * _e40);
        }
    }
    uint _e49 = li;
    float _e51 = b_lhs[_e49];
    uint _e53 = ri;
    float _e55 = b_rhs[_e53];
    uint _e58 = b_prm.op;
    float _e59 = binary_elem(_e51, _e55, _e58);
    b_y[_e3] = _e59;
    return;
}
