// Fuzz target: a YAML config through load_config_text (parse, check every key, validate). A config
// it accepts must dump (dump_config) to YAML that loads again and dumps the same.
#include <string>

#include "config/config.h"
#include "fuzz/targets.h"

namespace mop {

void fuzz_config(std::string_view bytes) {
  const Config cfg = load_config_text(std::string(bytes), {}, "fuzz.yaml");
  const std::string dumped = dump_config(cfg);
  const Config again = accepted_again(
      "the dumped config", [&] { return load_config_text(dumped, {}, "fuzz.yaml (dumped)"); });
  MOP_CHECK(dump_config(again) == dumped, "dump → load → dump changed the config:\n", dumped);
}

}  // namespace mop

MOP_FUZZ_MAIN(fuzz_config)
