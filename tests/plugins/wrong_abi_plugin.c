/* A plugin built against a future ABI: loading it must fail with exit code 2, naming both versions. */
#include "lossverify/plugin.h"

static int run_rank(const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c) {
  (void)in;
  (void)out;
  (void)c;
  return 1;
}

static const lv_plugin plugin = {LV_PLUGIN_ABI_VERSION + 1u,
                                 "wrong-abi",
                                 "built for another ABI",
                                 LV_MEMORY_HOST,
                                 LV_SUPPORTS_CROSS_ENTROPY,
                                 run_rank,
                                 NULL};

const lv_plugin* lossverify_plugin(void) { return &plugin; }
