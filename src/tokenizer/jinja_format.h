// Python's string formatting for the Jinja subset (jinja_interp.h): '%'-formatting (the `%`
// operator and the format filter), str.format with the format-spec mini-language, and the
// integer conversion they share with the filters. Results are Python's, widths and precisions
// counted in code points; what is not implemented is a template error (jinja::Error), never a
// different text (docs/ARCHITECTURE.md §7 lists it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace kv::jinja {

class Interp;

// Python's int(float): truncates; a float beyond int64 (Python would make a big int) or a NaN is
// an error here (OverflowError, ValueError), not a conversion with undefined behaviour.
bool fits_int64(double d);
int64_t float_to_int(double d);

// Python's s[:n] of a UTF-8 string: its first n code points (all of it when shorter).
std::string first_code_points(const std::string& s, int64_t n);

// fmt % args (args: the tuple's items, or the one value): %s %r %d %i %f %F %e %E %g %G and %%,
// flags - + space 0 #, width and precision (each at most 4096).
std::string py_format(const std::string& fmt, const std::vector<Value>& args);

// s.format(*a.pos, **a.kw): {} / {0} / {name} fields, !s / !r, and format specs
// [[fill]align][sign][#][0][width][.precision][type] with types s d b o x X e E f F g G % and none.
// in: the output bound.
std::string py_str_format(Interp& in, const std::string& s, const CallArgs& a);

}  // namespace kv::jinja
