// AdamW8bit's blockwise update on CPU in one pass over each block (see _native.py).
//
// Per block: decode both moments, update them and the parameter in float32 into two small
// buffers, take the new absmax, encode. Everything between reading and writing a block stays
// in L1. The arithmetic is update_blocks' (_blockwise.py) op for op, so the bits equal the
// eager path's; the build passes -ffp-contract=off so that no multiply-add is contracted into
// an FMA, and std::sqrt and '/' are IEEE (correctly rounded) on every x86 and ARM target.
// Plain loops the compiler vectorizes (table reads become gathers); no intrinsics, so one
// source serves every target.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

inline int32_t float_bits(float x) {
    int32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits;
}

inline float bits_float(int32_t bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

// Parameter and gradient storage: float32, or bfloat16 as its 16 high bits.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bits_float(int32_t(p[i]) << 16); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {
    // torch's float -> bfloat16: round to nearest even, NaN to 0x7FC0.
    uint32_t bits = uint32_t(float_bits(x));
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    p[i] = x != x ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// _quantize.nearest_codes: one table read per element.
inline uint8_t nearest_code(float x, const int32_t* __restrict lookup) {
    int32_t bits = float_bits(x);
    int32_t entry = lookup[(bits >> 15) & 0x1FFFF];
    int32_t low = bits & 0x7FFF;
    low = bits < 0 ? (low ^ 0x7FFF) : low;
    return uint8_t((entry >> 16) + (low >= (entry & 0xFFFF) ? 1 : 0));
}

// The largest |x| of n floats (NaN if any is NaN, as torch's amax): for non-negative floats
// the bit patterns order like the values, and an integer max vectorizes where a float one
// (with NaN rules) does not.
inline float absmax(const float* __restrict x, int64_t n) {
    int32_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
        int32_t bits = float_bits(x[i]) & 0x7FFFFFFF;
        best = bits > best ? bits : best;
    }
    return best > 0x7F800000 ? NAN : bits_float(best);
}

struct Args {
    void* param;
    const void* grad;
    uint8_t* exp_avg;
    float* exp_avg_scale;
    uint8_t* exp_avg_sq;
    float* exp_avg_sq_scale;
    int64_t rows, cols, block_rows, block_cols;
    const float* scalars;  // _blockwise.step_scalars, in its order
    const float* signed_map;
    const float* unsigned_map;
    const int32_t* signed_lookup;
    const int32_t* unsigned_lookup;
};

template <typename T>
void update_row_blocks(const Args& a, int64_t first, int64_t end) {
    T* __restrict param = static_cast<T*>(a.param);
    const T* __restrict grad = static_cast<const T*>(a.grad);
    uint8_t* __restrict m_codes = a.exp_avg;
    uint8_t* __restrict v_codes = a.exp_avg_sq;
    const float* __restrict signed_map = a.signed_map;
    const float* __restrict unsigned_map = a.unsigned_map;
    const float decay = a.scalars[0], w1 = a.scalars[1], beta2 = a.scalars[2];
    const float w2 = a.scalars[3], bias2_sqrt = a.scalars[4], eps = a.scalars[5];
    const float neg_step_size = a.scalars[6];
    const float one_minus_w1 = 1.0f - w1;
    const int32_t below_mask = w1 < 0.5f ? -1 : 0;  // torch's lerp changes formula at 0.5
    const int64_t cols = a.cols, grid_cols = (cols + a.block_cols - 1) / a.block_cols;
    std::vector<float> m_block(a.block_rows * a.block_cols), v_block(m_block.size());
    float m_values[256], v_values[256];
    for (int64_t rb = first; rb < end; ++rb) {
        const int64_t r0 = rb * a.block_rows;
        const int64_t r1 = r0 + a.block_rows < a.rows ? r0 + a.block_rows : a.rows;
        for (int64_t cb = 0; cb < grid_cols; ++cb) {
            const int64_t c0 = cb * a.block_cols;
            const int64_t width = (c0 + a.block_cols < cols ? c0 + a.block_cols : cols) - c0;
            float* const m_scale = a.exp_avg_scale + rb * grid_cols + cb;
            float* const v_scale = a.exp_avg_sq_scale + rb * grid_cols + cb;
            // The block's 256 decoded values of each moment (the same products the eager
            // path forms per element): one table read per element, no multiply.
            for (int k = 0; k < 256; ++k) {
                m_values[k] = signed_map[k] * *m_scale;
                v_values[k] = unsigned_map[k] * *v_scale;
            }
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t row = r * cols + c0;
                float* __restrict mb = m_block.data() + (r - r0) * width;
                float* __restrict vb = v_block.data() + (r - r0) * width;
#pragma GCC ivdep
                for (int64_t j = 0; j < width; ++j) {
                    float m = m_values[m_codes[row + j]];
                    float v = v_values[v_codes[row + j]];
                    const float start = load(param, row + j);
                    float g = load(grad, row + j);
                    // Selects as bit masks (all ones where the gradient is finite): GCC turns
                    // '?:' selects into masked loads and stores here, and a masked table read
                    // does not vectorize.
                    const int32_t finite = -int32_t((float_bits(g) & 0x7F800000) != 0x7F800000);
                    g = bits_float(float_bits(g) & finite);
                    const float diff = g - m;
                    // Both of lerp's forms, then a bitwise select (as above).
                    const int32_t below = float_bits(m + w1 * diff);
                    const int32_t above = float_bits(g - diff * one_minus_w1);
                    m = bits_float((below & below_mask) | (above & ~below_mask));
                    const float g_weighted = w2 * g;
                    v = v * beta2 + g_weighted * g;
                    const float denom = std::sqrt(v) / bias2_sqrt + eps;
                    const float step = neg_step_size * m;
                    const float updated = start * decay + step / denom;
                    store(param, row + j,
                          bits_float((float_bits(updated) & finite) | (float_bits(start) & ~finite)));
                    mb[j] = bits_float(float_bits(m) & finite);
                    vb[j] = bits_float(float_bits(v) & finite);
                }
            }
            const int64_t n = (r1 - r0) * width;
            const float m_new_scale = absmax(m_block.data(), n);
            const float v_new_scale = absmax(v_block.data(), n);
            *m_scale = m_new_scale;
            *v_scale = v_new_scale;
            const float m_div = m_new_scale > 0.0f ? m_new_scale : 1.0f;  // zero block: 0/1
            const float v_div = v_new_scale > 0.0f ? v_new_scale : 1.0f;
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t row = r * cols + c0;
                const float* __restrict mb = m_block.data() + (r - r0) * width;
                const float* __restrict vb = v_block.data() + (r - r0) * width;
#pragma GCC ivdep
                for (int64_t j = 0; j < width; ++j) {
                    m_codes[row + j] = nearest_code(mb[j] / m_div, a.signed_lookup);
                    v_codes[row + j] = nearest_code(vb[j] / v_div, a.unsigned_lookup);
                }
            }
        }
    }
}

}  // namespace

// Updates a (rows, cols) piece in place, its row blocks split over num_threads threads.
// bfloat16: 1 for bfloat16 parameter and gradient, 0 for float32.
extern "C" void ragged_adamw8bit_update(
    void* param, const void* grad, uint8_t* exp_avg, float* exp_avg_scale, uint8_t* exp_avg_sq,
    float* exp_avg_sq_scale, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
    const float* scalars, const float* signed_map, const float* unsigned_map,
    const int32_t* signed_lookup, const int32_t* unsigned_lookup, int32_t bfloat16,
    int32_t num_threads) {
    const Args a{param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale,
                 rows, cols, block_rows, block_cols, scalars, signed_map, unsigned_map,
                 signed_lookup, unsigned_lookup};
    auto run = bfloat16 ? update_row_blocks<uint16_t> : update_row_blocks<float>;
    const int64_t num_row_blocks = (rows + block_rows - 1) / block_rows;
    const int64_t workers = num_threads < num_row_blocks ? num_threads : num_row_blocks;
    if (workers <= 1) {
        run(a, 0, num_row_blocks);
        return;
    }
    std::vector<std::thread> threads;
    for (int64_t w = 1; w < workers; ++w) {
        threads.emplace_back(run, std::cref(a), num_row_blocks * w / workers,
                             num_row_blocks * (w + 1) / workers);
    }
    run(a, 0, num_row_blocks / workers);
    for (auto& t : threads) t.join();
}
