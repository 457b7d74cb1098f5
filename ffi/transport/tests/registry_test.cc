// Tests of the transport table (ffi/transport/registry.h) and its setting JAXCOMM_TRANSPORT
// (settings.h): the names it takes, what "auto" picks per memory kind, the refusal of a
// transport that cannot move a kind, and a world made through the table behind the interface.
#include "ffi/transport/registry.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "ffi/transport/settings.h"
#include "ffi/transport/tests/scoped_env.h"

namespace jaxcomm::transport {
namespace {

TEST(Registry, NamesEveryTransportOnce) {
  EXPECT_EQ(TransportChoices(), "auto, ucx, nccl");
  ASSERT_NE(FindTransport("ucx"), nullptr);
  EXPECT_TRUE(FindTransport("ucx")->Moves(MemoryKind::kHost));
  EXPECT_FALSE(FindTransport("ucx")->Moves(MemoryKind::kDevice));
  EXPECT_TRUE(FindTransport("ucx")->Accepts(MemoryKind::kDevice));  // host-staged
  ASSERT_NE(FindTransport("nccl"), nullptr);
  EXPECT_TRUE(FindTransport("nccl")->Moves(MemoryKind::kDevice));
  EXPECT_FALSE(FindTransport("nccl")->Accepts(MemoryKind::kHost));
  EXPECT_EQ(FindTransport("nccl")->create_world, nullptr);  // made per group by its handlers
  EXPECT_EQ(FindTransport("auto"), nullptr);
  EXPECT_EQ(FindTransport("tcp"), nullptr);
}

TEST(Registry, AutoPicksTheFirstTransportThatMovesTheKind) {
  const Selection host = SelectTransport(MemoryKind::kHost, "auto");
  ASSERT_NE(host.entry, nullptr) << host.error;
  EXPECT_STREQ(host.entry->name, "ucx");
  const Selection device = SelectTransport(MemoryKind::kDevice, "auto");
  ASSERT_NE(device.entry, nullptr) << device.error;
  EXPECT_STREQ(device.entry->name, "nccl");
}

TEST(Registry, RefusesATransportThatCannotMoveTheKind) {
  const Selection nccl_on_host = SelectTransport(MemoryKind::kHost, "nccl");
  EXPECT_EQ(nccl_on_host.entry, nullptr);
  EXPECT_NE(nccl_on_host.error.find("JAXCOMM_TRANSPORT='nccl' cannot move host"), std::string::npos)
      << nccl_on_host.error;
  EXPECT_NE(nccl_on_host.error.find("ucx can"), std::string::npos) << nccl_on_host.error;
}

TEST(Registry, UcxTakesDeviceBuffersOnlyWhenNamed) {
  // Host-staged (ffi/cuda/host_staged.h): chosen by name, never by "auto".
  const Selection ucx_on_device = SelectTransport(MemoryKind::kDevice, "ucx");
  ASSERT_NE(ucx_on_device.entry, nullptr) << ucx_on_device.error;
  EXPECT_STREQ(ucx_on_device.entry->name, "ucx");
  EXPECT_STREQ(SelectTransport(MemoryKind::kDevice, "auto").entry->name, "nccl");
}

TEST(Registry, SettingTakesTheTableNamesOnly) {
  std::string name;
  EXPECT_EQ(ReadTransportName(&name), "");
  EXPECT_EQ(name, "auto");
  {
    ScopedEnv ucx("JAXCOMM_TRANSPORT", "ucx");
    EXPECT_EQ(ReadTransportName(&name), "");
    EXPECT_EQ(name, "ucx");
  }
  ScopedEnv bad("JAXCOMM_TRANSPORT", "carrier-pigeon");
  const std::string error = ReadTransportName(&name);
  EXPECT_NE(error.find("JAXCOMM_TRANSPORT='carrier-pigeon' is not one of auto, ucx, nccl"),
            std::string::npos)
      << error;
  EXPECT_EQ(name, "auto");
  EXPECT_EQ(CheckWorldSettings(), error);
  std::string create_error;
  EXPECT_EQ(CreateWorld(1, {0}, &create_error), nullptr);
  EXPECT_NE(create_error.find("carrier-pigeon"), std::string::npos) << create_error;
}

// A world made through the table, used only through the interface: a ring of two ranks
// hosted by one process, one thread each.
TEST(Registry, WorldThroughTheInterface) {
  std::string error;
  std::unique_ptr<Transport> world = CreateWorld(2, {0, 1}, &error);
  ASSERT_NE(world, nullptr) << error;
  EXPECT_STREQ(world->name(), "ucx");
  EXPECT_TRUE(world->Accepts(MemoryKind::kHost));
  std::vector<std::string> addresses = {world->Address(0), world->Address(1)};
  ASSERT_TRUE(world->Connect(addresses, &error)) << error;
  int got[2] = {-1, -1};
  Status status[2];
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      const int mine = 10 + rank;
      const int peer = 1 - rank;
      Request requests[2];
      requests[0] = world->PostRecv(rank, peer, MakeTag(1, 0, peer), &got[rank], sizeof(int));
      requests[1] = world->PostSend(rank, peer, MakeTag(1, 0, rank), &mine, sizeof(int));
      status[rank] = world->Wait(rank, requests, 2, DefaultDeadline(), "ring");
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(status[rank].ok()) << status[rank].message();
    EXPECT_EQ(got[rank], 10 + (1 - rank));
    EXPECT_EQ(world->GetCounters(rank).messages_received, 1u);
  }
}

}  // namespace
}  // namespace jaxcomm::transport
