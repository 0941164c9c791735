// Registries: extension points (models, datasets, losses, optimizers, ...)
// map a name to a factory. Built-ins register exactly as a user does, from a
// static initializer, so adding one edits no if-chain:
//
//   using ModelFactory = std::function<absl::StatusOr<ModelSource>(const ComponentArgs&)>;
//   Registry<ModelFactory>& ModelRegistry();   // one function per registry
//   TRIDENT_REGISTER(ModelRegistry, "my_net", MakeMyNet);  // at namespace scope
//
// TRIDENT_REGISTER is the one spelling of a registration, for every registry
// (models, losses, optimizers, datasets, schedules, partition and split
// methods, LR schedules, precision modes, tokenizers, replacement pairs).
//
// A library holding registrations must be linked whole (`alwayslink = True` in
// Bazel), or the linker drops the unreferenced object file and its registration.
//
// ComponentArgs are a component's arguments by name, as a config's
// `args { key: "n_layer" value: "4" }` gives them, with typed readers whose
// errors name the argument.
#ifndef TRIDENT_BASE_REGISTRY_H_
#define TRIDENT_BASE_REGISTRY_H_

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace trident {

// Name -> factory. Thread-safe; entries are never removed.
template <typename Factory>
class Registry {
 public:
  // `kind` names the entries in errors ("model", "loss").
  explicit Registry(std::string kind) : kind_(std::move(kind)) {}

  // Adds `name`; a second registration of the same name is a programming
  // error reported by Find. Returns true (for static initializers).
  bool Register(const std::string& name, Factory factory) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!entries_.emplace(name, std::move(factory)).second) duplicates_.insert(name);
    return true;
  }

  // The factory registered as `name`; the error lists the registered names.
  absl::StatusOr<Factory> Find(absl::string_view name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string key(name);
    if (duplicates_.count(key)) {
      return absl::FailedPreconditionError(
          absl::StrCat(kind_, " '", name, "' is registered twice; give one of them another name"));
    }
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      std::vector<std::string> names;
      for (const auto& entry : entries_) names.push_back(entry.first);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown ", kind_, " '", name, "'; choose ", absl::StrJoin(names, ", ")));
    }
    return it->second;
  }

  bool Contains(absl::string_view name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.count(std::string(name)) > 0;
  }

  std::vector<std::string> Names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> names;
    for (const auto& entry : entries_) names.push_back(entry.first);
    return names;
  }

 private:
  std::string kind_;
  mutable std::mutex mutex_;
  std::map<std::string, Factory> entries_;
  std::set<std::string> duplicates_;
};

// A component's arguments by name (text values, parsed on reading).
class ComponentArgs {
 public:
  ComponentArgs() = default;
  // `owner` names the component in errors ("model 'gpt'").
  ComponentArgs(std::string owner, std::map<std::string, std::string> values)
      : owner_(std::move(owner)), values_(std::move(values)) {}

  bool Has(absl::string_view key) const { return values_.count(std::string(key)) > 0; }
  void Set(const std::string& key, std::string value) { values_[key] = std::move(value); }
  const std::map<std::string, std::string>& values() const { return values_; }
  const std::string& owner() const { return owner_; }

  std::string GetString(absl::string_view key, absl::string_view fallback) const {
    auto it = values_.find(std::string(key));
    return it == values_.end() ? std::string(fallback) : it->second;
  }
  absl::StatusOr<int64_t> GetInt(absl::string_view key, int64_t fallback) const {
    return Parse<int64_t>(key, fallback, "an integer");
  }
  absl::StatusOr<double> GetDouble(absl::string_view key, double fallback) const {
    return Parse<double>(key, fallback, "a number");
  }
  absl::StatusOr<bool> GetBool(absl::string_view key, bool fallback) const {
    return Parse<bool>(key, fallback, "true or false");
  }
  // Errors naming every argument not in `known` (a misspelt argument is never ignored).
  absl::Status CheckKnown(const std::vector<std::string>& known) const {
    std::vector<std::string> unknown;
    for (const auto& [key, value] : values_) {
      bool found = false;
      for (const std::string& k : known) found |= k == key;
      if (!found) unknown.push_back(key);
    }
    if (unknown.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(owner_, " has no argument(s) ", absl::StrJoin(unknown, ", "),
                                                   "; it takes ", absl::StrJoin(known, ", ")));
  }

 private:
  template <typename T>
  absl::StatusOr<T> Parse(absl::string_view key, T fallback, absl::string_view what) const {
    auto it = values_.find(std::string(key));
    if (it == values_.end()) return fallback;
    T value;
    bool parsed;
    if constexpr (std::is_same_v<T, bool>) {
      parsed = absl::SimpleAtob(it->second, &value);
    } else if constexpr (std::is_same_v<T, double>) {
      parsed = absl::SimpleAtod(it->second, &value);
    } else {
      parsed = absl::SimpleAtoi(it->second, &value);
    }
    if (!parsed) {
      return absl::InvalidArgumentError(absl::StrCat(owner_, ": argument ", key, "='", it->second, "' is not ", what));
    }
    return value;
  }

  std::string owner_;
  std::map<std::string, std::string> values_;
};

}  // namespace trident

// Registers `...` (the factory) as `name` in `registry` (the function that
// returns the Registry, namespace-qualified where needed) at static
// initialisation. Use it at namespace scope, any number of times per file.
#define TRIDENT_REGISTER(registry, name, ...)                                                     \
  [[maybe_unused]] static const bool TRIDENT_REGISTRY_CONCAT_(trident_registered_, __COUNTER__) = \
      registry().Register(name, __VA_ARGS__)

#define TRIDENT_REGISTRY_CONCAT_INNER_(a, b) a##b
#define TRIDENT_REGISTRY_CONCAT_(a, b) TRIDENT_REGISTRY_CONCAT_INNER_(a, b)

#endif  // TRIDENT_BASE_REGISTRY_H_
