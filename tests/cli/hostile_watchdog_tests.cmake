# Hostile-input suite: see tests/CMakeLists.txt.
