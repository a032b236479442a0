// Drives Gloo's uv address codec (our patch 0006) from the command line so that
// tests/test_uv_address.py can feed it byte strings laid out as macOS and Linux
// write them. Built by that test against the patched Horovod source, with
// AddressSanitizer: a read past the end of any input aborts the tool.
//
//   encode <linux|darwin> <seq> <sockaddr hex>   sockaddr as that OS lays it out -> wire hex
//   decode <linux|darwin> <wire hex>             wire -> "<sockaddr hex> <seq>" in that layout
//   address-bytes <ip> <port> <seq>              this host's uv::Address -> wire hex
//   address-parse <wire hex>                     wire -> uv::Address(bytes).str()
//   seq <hex>                                    pair handshake bytes -> sequence number
//
// Errors print "error: <message>" on stderr and exit 3.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <gloo/transport/uv/address.h>
#include <gloo/transport/uv/address_wire.h>

namespace wire = gloo::transport::uv::wire;

static std::vector<char> unhex(const std::string& hex) {
  if (hex.size() % 2 != 0) {
    throw std::invalid_argument("odd number of hex digits");
  }
  std::vector<char> out(hex.size() / 2);  // exactly the input's size: ASan sees overreads
  for (size_t i = 0; i < out.size(); i++) {
    out[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  return out;
}

static std::string tohex(const void* data, size_t len) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < len; i++) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

static wire::Layout layout(const std::string& name) {
  if (name == "linux") return wire::Layout::Linux;
  if (name == "darwin") return wire::Layout::Darwin;
  throw std::invalid_argument("layout must be linux or darwin, got " + name);
}

int main(int argc, char** argv) {
  std::vector<std::string> a(argv, argv + argc);
  try {
    if (a.size() == 5 && a[1] == "encode") {
      auto raw = unhex(a[4]);
      auto ep = wire::fromSockaddr(reinterpret_cast<const uint8_t*>(raw.data()), raw.size(), layout(a[2]));
      ep.seq = std::stoi(a[3]);
      auto out = wire::encode(ep);
      std::cout << tohex(out.data(), out.size()) << std::endl;
      return 0;
    }
    if (a.size() == 4 && a[1] == "decode") {
      auto raw = unhex(a[3]);
      auto ep = wire::decode(raw.data(), raw.size());
      uint8_t ss[sizeof(struct sockaddr_storage)];
      auto n = wire::toSockaddr(ep, layout(a[2]), ss, sizeof(ss));
      std::cout << tohex(ss, n) << " " << ep.seq << std::endl;
      return 0;
    }
    if (a.size() == 5 && a[1] == "address-bytes") {
      struct sockaddr_storage ss;
      std::memset(&ss, 0, sizeof(ss));
      const int port = std::stoi(a[3]);
      auto* in4 = reinterpret_cast<struct sockaddr_in*>(&ss);
      auto* in6 = reinterpret_cast<struct sockaddr_in6*>(&ss);
      if (inet_pton(AF_INET, a[2].c_str(), &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
      } else if (inet_pton(AF_INET6, a[2].c_str(), &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
      } else {
        throw std::invalid_argument("not an IP address: " + a[2]);
      }
      auto bytes = gloo::transport::uv::Address(ss, std::stoi(a[4])).bytes();
      std::cout << tohex(bytes.data(), bytes.size()) << std::endl;
      return 0;
    }
    if (a.size() == 3 && a[1] == "address-parse") {
      gloo::transport::uv::Address addr(unhex(a[2]));
      std::cout << addr.str() << std::endl;
      return 0;
    }
    if (a.size() == 3 && a[1] == "seq") {
      auto raw = unhex(a[2]);
      std::cout << wire::decodeSeq(raw.data(), raw.size()) << std::endl;
      return 0;
    }
    std::cerr << "usage: see the comment at the top of uv_address_tool.cc" << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 3;
  }
}
