// How triedec's packed linears cut their work (a8_linears.cpp, f32_linears.cpp). Their weights go
// in blocks of 4 vectors of 16 outputs (the last block may hold fewer), each block one sequential
// stream; a block is computed in register tiles of a few rows x the block's vectors, each tile
// reading the stream once, in order, the first bringing it from memory for the others. The rows
// are cut into ceil(R / rows_per_tile) tiles of as even sizes as can be, the larger first (16 rows
// in tiles of 3: 3, 3, 3, 3, 2, 2). The parallel work items are (block, part) pairs, a part being a
// run of consecutive row tiles: one part per block when there are blocks enough to keep every
// thread busy, else as many as it takes (up to one per tile), so that a layer of few blocks splits
// evenly over the threads at many rows. Each output is computed whole by one tile, so no output's
// operations depend on R, the cut or the thread count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace triedec {

// Calls body(b, r0, rows, first) for every tile: block b, rows r0 .. r0 + rows (rows <=
// rows_per_tile), first when the tile is its part's first (the one that brings the block's stream
// from memory), the (block, part) items spread over torch's intra-op threads.
template <class Body>
inline void for_each_row_tile(int64_t R, int64_t rows_per_tile, int64_t blocks, Body&& body) {
  const int64_t tiles = (R + rows_per_tile - 1) / rows_per_tile;
  const int64_t wanted = 8 * std::max<int64_t>(1, at::get_num_threads());  // work items for an even split
  const int64_t parts = std::min<int64_t>(tiles, std::max<int64_t>(1, (wanted + blocks - 1) / blocks));
  // tile t covers rows [row_of(t), row_of(t + 1)): sizes differ by at most one, the larger first
  const auto row_of = [&](int64_t t) { return R - (tiles - t) * R / tiles; };
  at::parallel_for(0, blocks * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / parts, part = item % parts;
      const int64_t t0 = part * tiles / parts;
      for (int64_t t = t0; t < (part + 1) * tiles / parts; ++t) {
        const int64_t r0 = row_of(t);
        body(b, r0, static_cast<int>(row_of(t + 1) - r0), t == t0);
      }
    }
  });
}

// Calls f(rows, vectors) with both as compile-time constants (std::integral_constant), rows in
// 1..MaxRows (at most 4) and vectors in 1..4: the tiles are templates over their shape, so
// registers hold them.
template <int MaxRows, class F>
inline void dispatch_tile(int rows, int vectors, F&& f) {
  static_assert(MaxRows >= 1 && MaxRows <= 4, "dispatch_tile names tiles of 1 to 4 rows");
  const auto with_rows = [&](auto r) {
    switch (vectors) {
      case 1: return f(r, std::integral_constant<int, 1>{});
      case 2: return f(r, std::integral_constant<int, 2>{});
      case 3: return f(r, std::integral_constant<int, 3>{});
      default: return f(r, std::integral_constant<int, 4>{});
    }
  };
  switch (std::min(rows, MaxRows)) {
    case 1: return with_rows(std::integral_constant<int, 1>{});
    case 2: if constexpr (MaxRows >= 2) return with_rows(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (MaxRows >= 3) return with_rows(std::integral_constant<int, 3>{}); break;
    default: if constexpr (MaxRows >= 4) return with_rows(std::integral_constant<int, 4>{}); break;
  }
}

}  // namespace triedec
