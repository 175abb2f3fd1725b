/* A shared library without the lossverify_plugin entry point: loading it must fail with exit code 2. */
int not_a_plugin(void) { return 42; }
