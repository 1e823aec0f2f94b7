// HTTP plumbing shared by the server (http_server.h) and the router (router/router.h): JSON
// answers, OpenAI-shaped errors for what cpp-httplib answers itself, the listen backlog.
#pragma once
#include <cstddef>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "server/api_error.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kv {

void write_error(httplib::Response& res, const ApiError& e);
void write_json(httplib::Response& res, const nlohmann::ordered_json& j);

// Statuses httplib produces itself (no route, body too large, unparsable HTTP) and exceptions
// that escape a handler get an OpenAI-shaped JSON body.
void install_json_errors(httplib::Server& svr, size_t max_body_bytes);

// Wraps a handler: ApiError → its status; any other exception → 500. Nothing escapes.
std::function<void(const httplib::Request&, httplib::Response&)> safe_handler(
    std::function<void(const httplib::Request&, httplib::Response&)> fn);

// Debian's cpp-httplib (0.11, compiled into its .so) listens with a backlog of 5: 64 clients
// connecting at once overflow it. Raises the backlog of this process's socket bound to `port`.
void raise_listen_backlog(int port);

int64_t unix_now();

}  // namespace kv
