// How the reference's per-module options (LoRA's target_modules, Merak's
// tensor-parallel layer lists, ATorch's checkpoint method) name modules.
#ifndef TRIDENT_BASE_MODULE_NAMES_H_
#define TRIDENT_BASE_MODULE_NAMES_H_

#include <string>

namespace trident {

// Whether module `name` ("transformer.h.0.attn") is meant by `pattern`: the
// full name, or a suffix after a '.' ("attn", "h.0.attn").
inline bool ModuleNameMatches(const std::string& name, const std::string& pattern) {
  return name == pattern || (name.size() > pattern.size() && name[name.size() - pattern.size() - 1] == '.' &&
                             name.compare(name.size() - pattern.size(), pattern.size(), pattern) == 0);
}

// Whether parameter or module `name` ("transformer.h.0.attn.c_attn.weight")
// lies under module `module` ("transformer.h", "transformer.h.0"): the module
// itself or a name below it.
inline bool IsUnderModule(const std::string& name, const std::string& module) {
  return name.size() >= module.size() && name.compare(0, module.size(), module) == 0 &&
         (name.size() == module.size() || name[module.size()] == '.');
}

// Whether a module of class `type_name` is meant by `pattern`: the class's
// own name after any namespace or module path ("trident::BlockImpl",
// "__torch__.model.Block"), with or without a C++ module's "Impl" suffix.
inline bool ModuleTypeMatches(const std::string& type_name, const std::string& pattern) {
  if (pattern.empty()) return false;
  const size_t cut = type_name.find_last_of(".:");
  const std::string own = cut == std::string::npos ? type_name : type_name.substr(cut + 1);
  return own == pattern || own == pattern + "Impl";
}

}  // namespace trident

#endif  // TRIDENT_BASE_MODULE_NAMES_H_
