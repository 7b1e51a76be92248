// mop — command-line entry point.
#include <cstdio>
int main() { std::puts("mop"); return 0; }
