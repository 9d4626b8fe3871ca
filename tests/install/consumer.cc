// Builds against the installed package and uses it: a page table from counts.
#include <cstdio>

#include "sparsepage/page_table.h"

int main() {
  const auto table = sparsepage::build_page_table_structure({5, 0, 17}, 4, {1, 0, 3});
  if (table.num_pages() != 2 + 0 + 5 || !sparsepage::page_table_problem(table).empty()) {
    std::printf("consumer: unexpected page table\n");
    return 1;
  }
  std::printf("consumer: ok (%lld pages)\n", static_cast<long long>(table.num_pages()));
  return 0;
}
