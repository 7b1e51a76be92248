// Figures as people read them in reports: whole numbers with their digits grouped by three
// (514,733 tokens/s), as the docs write them.
#pragma once

#include <cmath>
#include <string>

namespace mop {

// `x` rounded to a whole number, digits grouped by three with commas: 514733.4 → "514,733".
inline std::string grouped(double x) {
  if (!std::isfinite(x)) return x != x ? "nan" : x < 0 ? "-inf" : "inf";
  const double r = std::round(std::fabs(x));
  std::string digits = r < 1e18 ? std::to_string(static_cast<long long>(r)) : std::to_string(r);
  if (const size_t dot = digits.find('.'); dot != std::string::npos) digits.resize(dot);
  std::string out = x < 0 && r > 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace mop
