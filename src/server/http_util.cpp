#include "server/http_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>

#include <httplib.h>

namespace kv {

void write_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump_json(e.to_json()), "application/json");
}

void write_json(httplib::Response& res, const nlohmann::ordered_json& j) {
  res.status = 200;
  res.set_content(dump_json(j), "application/json");
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void install_json_errors(httplib::Server& svr, size_t max_body_bytes) {
  svr.set_error_handler(httplib::Server::HandlerWithResponse([max_body_bytes](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e{res.status, "", error_type_for_status(res.status), "", ""};
    switch (res.status) {
      case 404: e.message = "Not found: " + req.method + " " + req.path; e.code = "not_found"; break;
      case 413:
        e.message = "The request body is too large: the limit is " + std::to_string(max_body_bytes) + " bytes.";
        e.code = "payload_too_large";
        break;
      case 414: e.message = "The request URI is too long."; break;
      default: e.message = "The HTTP request could not be handled (status " + std::to_string(res.status) + ")."; break;
    }
    write_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));

  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    write_error(res, ApiError{500, "Internal server error: " + what, "server_error", "", ""});
  });
}

std::function<void(const httplib::Request&, httplib::Response&)> safe_handler(
    std::function<void(const httplib::Request&, httplib::Response&)> fn) {
  return [fn = std::move(fn)](const httplib::Request& req, httplib::Response& res) {
    try {
      fn(req, res);
    } catch (const ApiError& e) {
      write_error(res, e);
    } catch (const std::exception& e) {
      write_error(res, ApiError{500, std::string("Internal server error: ") + e.what(), "server_error", "", ""});
    } catch (...) {
      write_error(res, ApiError{500, "Internal server error.", "server_error", "", ""});
    }
  };
}

// Linux lets listen() be called again on a listening socket to change the backlog, so find the
// socket bound to `port` among this process's descriptors and raise it.
void raise_listen_backlog(int port) {
  for (int fd = 0; fd < 4096; ++fd) {
    int accepting = 0;
    socklen_t len = sizeof accepting;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || !accepting) continue;
    sockaddr_storage addr{};
    socklen_t alen = sizeof addr;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) continue;
    int bound = -1;
    if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    if (bound == port) ::listen(fd, SOMAXCONN);
  }
}

}  // namespace kv
